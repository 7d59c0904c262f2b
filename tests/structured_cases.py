"""Prompts and small JSON schemas shared by the structured-output tests (pipeline and stack).

Extraction prompts keep SmolLM2-135M's greedy output short; strings, numbers and arrays are bounded
so each document ends well within ``MAX_TOKENS``.
"""

from __future__ import annotations

MAX_TOKENS = 64

_NAME = {"type": "string", "maxLength": 16}
_AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMA_CASES: list[tuple[str, dict]] = [
    (
        "Alice is 30 years old. Extract her name and age as JSON.",
        {"type": "object", "properties": {"name": _NAME, "age": _AGE}, "required": ["name", "age"]},
    ),
    (
        "The sky is blue. Is this statement true? Answer as JSON.",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "Classify the sentiment of 'I love this film' as JSON.",
        {
            "type": "object",
            "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
            "required": ["sentiment"],
        },
    ),
    (
        "List three primary colours as JSON.",
        {
            "type": "object",
            "properties": {"colours": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}},
            "required": ["colours"],
        },
    ),
    (
        "A pen costs 1.5 dollars. Give the price as JSON.",
        {
            "type": "object",
            "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
            "required": ["price"],
        },
    ),
    (
        "Bob lives in Paris, France. Extract his address as JSON.",
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "address": {
                    "type": "object",
                    "properties": {"city": _NAME, "country": _NAME},
                    "required": ["city", "country"],
                },
            },
            "required": ["name", "address"],
        },
    ),
    (
        "Give the numbers one, two and three as JSON.",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    (
        "Carol (25) and Dan (40) are friends. Extract them as JSON.",
        {
            "type": "object",
            "properties": {
                "people": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": _NAME, "age": _AGE},
                        "required": ["name", "age"],
                    },
                    "maxItems": 2,
                }
            },
            "required": ["people"],
        },
    ),
    (
        "What is the capital of Italy? Answer as JSON with a confidence level.",
        {
            "type": "object",
            "properties": {"capital": _NAME, "confidence": {"enum": ["low", "medium", "high"]}},
            "required": ["capital", "confidence"],
        },
    ),
    (
        "Convert 'light on, brightness 80' into a JSON command.",
        {
            "type": "object",
            "properties": {
                "on": {"type": "boolean"},
                "brightness": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["on", "brightness"],
        },
    ),
]
"""(user prompt, JSON schema): nested objects, arrays, enums, required fields, numbers."""

TOOL_SETS: list[list[dict]] = [
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": {"type": "object", "properties": {"city": _NAME}, "required": ["city"]},
            },
        }
    ],
    [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    },
                    "required": ["a", "b"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "negate",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                    "required": ["x"],
                },
            },
        },
    ],
    [
        {
            "type": "function",
            "function": {
                "name": "send_email",
                "description": "Send an email",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "to": _NAME,
                        "urgent": {"type": "boolean"},
                        "tags": {"type": "array", "items": {"enum": ["work", "home"]}, "maxItems": 2},
                    },
                    "required": ["to", "urgent"],
                },
            },
        }
    ],
]
"""Three tool sets (one function; two functions; nested arrays and enums) with their questions below."""

TOOL_QUESTIONS = ["What is the weather in Oslo?", "What is 2 plus 3?", "Email Bob that the build is broken."]
