from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_OK: _ClassVar[StepFailure]
    STEP_REJECTED: _ClassVar[StepFailure]
    STEP_STALE: _ClassVar[StepFailure]
    STEP_FENCED: _ClassVar[StepFailure]
STEP_OK: StepFailure
STEP_REJECTED: StepFailure
STEP_STALE: StepFailure
STEP_FENCED: StepFailure

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "num_blocks", "max_model_len", "vocab_size", "eos_token_ids", "device", "dtype", "quantization", "kv_cache_dtype")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "include_stop_str_in_output", "json_schema", "regex", "choice", "grammar", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    include_stop_str_in_output: bool
    json_schema: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class SeqChunk(_message.Message):
    __slots__ = ("seq_id", "start_pos", "num_tokens", "token_ids", "sample", "params", "prompt_len", "block_ids", "prefix_token_ids", "lora_name")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_pos: int
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    params: SamplingParams
    prompt_len: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    def __init__(self, seq_id: _Optional[int] = ..., start_pos: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_len: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "chunks", "free_seq_ids", "num_passes", "fence")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PASSES_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    chunks: _containers.RepeatedCompositeFieldContainer[SeqChunk]
    free_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_passes: int
    fence: int
    def __init__(self, step_id: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[SeqChunk, _Mapping]]] = ..., free_seq_ids: _Optional[_Iterable[int]] = ..., num_passes: _Optional[int] = ..., fence: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "tokens", "forward_seconds", "num_free_blocks", "idle_seconds", "prompt_logprobs", "failure", "error", "num_passes", "fence")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_PASSES_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_seconds: float
    num_free_blocks: int
    idle_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    failure: StepFailure
    error: str
    num_passes: int
    fence: int
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_seconds: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., failure: _Optional[_Union[StepFailure, str]] = ..., error: _Optional[str] = ..., num_passes: _Optional[int] = ..., fence: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "start_pos", "logprobs", "top")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_pos: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., start_pos: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids", "all", "fence")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    all: bool
    fence: int
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., all: _Optional[bool] = ..., fence: _Optional[int] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_free_blocks", "fenced", "fence")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    fenced: bool
    fence: int
    def __init__(self, num_free_blocks: _Optional[int] = ..., fenced: _Optional[bool] = ..., fence: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "num_free_blocks", "num_running_seqs", "num_fenced", "fence", "num_lora_loads")
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCED_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    num_free_blocks: int
    num_running_seqs: int
    num_fenced: int
    fence: int
    num_lora_loads: int
    def __init__(self, ok: _Optional[bool] = ..., num_free_blocks: _Optional[int] = ..., num_running_seqs: _Optional[int] = ..., num_fenced: _Optional[int] = ..., fence: _Optional[int] = ..., num_lora_loads: _Optional[int] = ...) -> None: ...

class SeqMove(_message.Message):
    __slots__ = ("seq_id", "dest_block_ids", "num_shared_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_shared_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., num_shared_blocks: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("fence", "dest_address", "dest_fence", "moves")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    DEST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEST_FENCE_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    fence: int
    dest_address: str
    dest_fence: int
    moves: _containers.RepeatedCompositeFieldContainer[SeqMove]
    def __init__(self, fence: _Optional[int] = ..., dest_address: _Optional[str] = ..., dest_fence: _Optional[int] = ..., moves: _Optional[_Iterable[_Union[SeqMove, _Mapping]]] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("moved_seq_ids", "num_bytes", "seconds", "error", "fenced")
    MOVED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    moved_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    seconds: float
    error: str
    fenced: bool
    def __init__(self, moved_seq_ids: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., fenced: _Optional[bool] = ...) -> None: ...

class SeqState(_message.Message):
    __slots__ = ("seq_id", "num_computed", "last_token", "prompt_len", "prompt_token_ids", "output_token_ids", "params", "block_ids", "kv_dtype", "runner_state", "lora_name", "num_shared_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RUNNER_STATE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_computed: int
    last_token: int
    prompt_len: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_dtype: str
    runner_state: bytes
    lora_name: str
    num_shared_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., num_computed: _Optional[int] = ..., last_token: _Optional[int] = ..., prompt_len: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., kv_dtype: _Optional[str] = ..., runner_state: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., num_shared_blocks: _Optional[int] = ...) -> None: ...

class KVPart(_message.Message):
    __slots__ = ("fence", "state", "seq_id", "layer", "k", "v", "last")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    fence: int
    state: SeqState
    seq_id: int
    layer: int
    k: bytes
    v: bytes
    last: bool
    def __init__(self, fence: _Optional[int] = ..., state: _Optional[_Union[SeqState, _Mapping]] = ..., seq_id: _Optional[int] = ..., layer: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ImportResponse(_message.Message):
    __slots__ = ("seq_ids", "fenced", "error")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    fenced: bool
    error: str
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., fenced: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
