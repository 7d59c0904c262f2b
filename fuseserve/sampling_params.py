"""Placeholder: replaced by the sampling helper (SamplingParams with validate())."""

from dataclasses import dataclass


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
