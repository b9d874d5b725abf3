"""ServerConfig: what the HTTP layer needs to know (the engine has its own EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_N = 16  # samples a request may ask for (n, best_of): each one is a sequence in the batch
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default (and OpenAI's top_logprobs cap)
# A request's prompts run as that many engine requests: 64 serves batch clients, while one request can neither
# fill the queue nor hold a concurrent request for long (500 prompts held one 16.6 s; the 1 MiB body limit let
# a request carry about 90,000; vLLM has no cap)
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
# Waiting requests hold their prompts' token ids (and the HTTP side as many submissions on their way): 1024
# covers a 1000-request burst, as benchmarks send, and bounds what a flood can pile up
DEFAULT_MAX_QUEUE_LEN = 1024
DEFAULT_MAX_QUEUE_WAIT_S = 120.0  # under the usual client timeouts (300 s in dflash2 bench, 600 s in openai's)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the engine's model name
    model_aliases: tuple[str, ...] = ()  # other names a request may use for the model (e.g. the --model path)
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    streaming_timeout_ms: int | None = None  # None: streams never time out
    metrics_port: int | None = None
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    log_tokens: bool = False
    log_level: str = "info"
    stats_interval_s: float = 10.0  # how often the engine thread logs a stats line
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN  # waiting requests beyond this get 503 + Retry-After
    max_queue_wait_s: float | None = DEFAULT_MAX_QUEUE_WAIT_S  # a request expected to wait longer gets 503 too
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # logprobs / top_logprobs / prompt_logprobs above get 400
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # a completions request with more gets 400
    max_n: int = DEFAULT_MAX_N  # n or best_of above gets 400
    chat_template: str | None = None  # --chat-template: this template's text instead of the model's
    tool_call_parser: str = "auto"  # hermes, llama3_json, or auto: by the chat template (server/tools.py)
    # requests held (running, paused and waiting) beyond this get 503 too (--max-num-seqs beside
    # --max-batch-size); None: no bound besides max_queue_len
    max_held_requests: int | None = None
    single_process: bool = False  # the engine on a thread of the server's process, not a process of its own
    num_threads: int | None = None  # torch threads of the engine's process; None: its physical cores (cpu_threads)
    shutdown_timeout_s: float = 30.0  # on SIGTERM / SIGINT: how long in-flight requests may still run (drain)
    step_timeout_s: float | None = 300.0  # the watchdog: a step running longer turns /health to 503 (None: off)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [1, 65535], got {self.metrics_port}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"--step-timeout must be > 0, got {self.step_timeout_s:g}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s:g}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.streaming_timeout_ms is not None and self.streaming_timeout_ms < 1:
            raise ValueError(f"--streaming-timeout-ms must be >= 1, got {self.streaming_timeout_ms}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_queue_wait_s is not None and self.max_queue_wait_s <= 0:
            raise ValueError(f"the wait bound must be > 0 s or None, got {self.max_queue_wait_s}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"--max-queue-len must be >= 1, got {self.max_queue_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_prompts_per_request < 1:
            raise ValueError(f"--max-prompts-per-request must be >= 1, got {self.max_prompts_per_request}")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json"):
            raise ValueError(f"--tool-call-parser must be auto, hermes or llama3_json, got {self.tool_call_parser!r}")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_n}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
