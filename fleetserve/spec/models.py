"""Pydantic models of the service YAML: the `service:` section and the task fields.

Every model forbids unknown keys (as SkyServe's JSON schema does), so a typo is an error that
names the field instead of a silently ignored setting. Field defaults are SkyServe's.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fleetserve.core.errors import InvalidSpec

DEFAULT_INITIAL_DELAY_SECONDS = 1200
DEFAULT_PROBE_TIMEOUT_SECONDS = 15
DEFAULT_UPSCALE_DELAY_SECONDS = 300
DEFAULT_DOWNSCALE_DELAY_SECONDS = 1200
# SkyServe's three policies, then fleetserve's own (documented extensions).
LbPolicy = Literal[
    "round_robin",
    "least_load",
    "instance_aware_least_load",
    "power_of_two",
    "sticky",
    "prefix_affinity",
    "cache_aware",
]
DEFAULT_LB_POLICY: LbPolicy = "least_load"
FLEETSERVE_INFRAS = ("local", "ray")  # where replicas can run; any other infra is a cloud

# Every pattern is used with `fullmatch`: `$` in Python also matches before a trailing newline,
# so `re.match("^...$")` would take "name\n" (tests/unit/spec/test_limits.py shows it).
_ACCELERATOR_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(:\d+(\.\d+)?)?")
_CPUS = re.compile(r"\d+(\.\d+)?\+?")
# A size (`32`, `32GB`, `32+`), or SkyPilot's multiple of the vCPUs (`4x`, `4x+`).
_MEMORY = re.compile(r"\d+(\.\d+)?(\s*([kKmMgGtT][iI]?[bB]?)|x)?\+?")
_PORT_RANGE = re.compile(r"(\d+)(-(\d+))?")
# SkyPilot's task name rule (sky/task.py): letters and digits, joined by one or two of '._-'.
_TASK_NAME = re.compile(r"[A-Za-z0-9]+(?:[._-]{1,2}[A-Za-z0-9]+)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A probe path goes into a URL, which cannot hold control characters.
_PROBE_PATH = re.compile(r"/[^\x00-\x1f\x7f]*")

# The shape of a document: how deep values nest and how many there are (an alias or a JSON
# string counting as all it holds). The loader refuses a YAML beyond them, the probe model a
# JSON post_data string beyond them; both bound the walks that follow (pydantic, JSON, env
# substitution), whose recursion would otherwise fail far from the cause.
MAX_NESTING_DEPTH = 64
MAX_VALUES = 20_000


def _not_text(value: str) -> bool:
    """A string that is no text: a lone surrogate (YAML's "\\ud800" escape) has no UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def shape_error(value: Any) -> str | None:
    """Why `value` (JSON-like data) is beyond MAX_NESTING_DEPTH or MAX_VALUES, or holds a
    string that is no text (it could be neither stored nor passed to a process), if it is."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            return f"holds more than {MAX_VALUES} values"
        if depth > MAX_NESTING_DEPTH:
            return f"is nested deeper than {MAX_NESTING_DEPTH} levels"
        if isinstance(item, str) and _not_text(item):
            shown = item.encode("utf-8", "backslashreplace").decode()[:60]
            return f"holds a string that is not valid Unicode text (a lone surrogate): {shown!r}"
        if isinstance(item, dict):
            for k in item:
                if isinstance(k, str) and _not_text(k):
                    shown = k.encode("utf-8", "backslashreplace").decode()[:60]
                    return f"holds a key that is not valid Unicode text (lone surrogate): {shown!r}"
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return None


# The most replicas (or pool workers) any count field of a spec may ask for. `load_spec` reads
# it from the environment when it validates a YAML and hands it to the models in the
# validation context; specs read back from the store (validated when they came in) pass none.
DEFAULT_MAX_REPLICAS = 1000
MAX_REPLICAS_ENV = "FLEETSERVE_MAX_REPLICAS"
MAX_REPLICAS_CONTEXT = "max_replicas"


def max_replicas_limit(env: Mapping[str, str] | None = None) -> int:
    """FLEETSERVE_MAX_REPLICAS, else DEFAULT_MAX_REPLICAS."""
    raw = (os.environ if env is None else env).get(MAX_REPLICAS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_REPLICAS
    if not re.fullmatch(r"[0-9]{1,9}", raw) or int(raw) < 1:
        raise InvalidSpec(f"{MAX_REPLICAS_ENV}={raw!r}: must be a whole number >= 1")
    return int(raw)


def _within_replica_limit(value: int, info: ValidationInfo) -> int:
    limit = (info.context or {}).get(MAX_REPLICAS_CONTEXT)
    if limit is not None and value > limit:
        raise ValueError(f"must be <= {limit}, the limit on replica counts ({MAX_REPLICAS_ENV})")
    return value


# Strict types: YAML's `true` is not 1, "3" is not 3, 2.5 is not an int (as in SkyServe's JSON
# schema); a float is finite (an infinite one would be stored as JSON null and not read back).
def _integral(v: Any) -> Any:
    """1.0 is the integer 1, as JSON schema's `integer` (SkyPilot's) has it; 2.5 stays a float
    and is refused."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


StrictCount = Annotated[StrictInt, BeforeValidator(_integral), Field(ge=0)]
ReplicaCount = Annotated[StrictCount, AfterValidator(_within_replica_limit)]
FiniteFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Seconds = Annotated[FiniteFloat, Field(ge=0)]
PositiveFloat = Annotated[FiniteFloat, Field(gt=0)]
Port = Annotated[StrictInt, Field(ge=1, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# An HTTP field name: a token (RFC 9110 5.1).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _latin1(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


class ReadinessProbe(_Strict):
    path: str
    initial_delay_seconds: Seconds = DEFAULT_INITIAL_DELAY_SECONDS
    timeout_seconds: PositiveFloat = DEFAULT_PROBE_TIMEOUT_SECONDS
    post_data: dict[str, Any] | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    # SkyServe's per-service probe cadence and failure window; None: the controller's
    # FLEETSERVE_PROBE_INTERVAL and FLEETSERVE_FAILURE_WINDOW.
    endpoint_probe_interval_seconds: Annotated[PositiveFloat, Field(le=3600)] | None = None
    consecutive_failure_threshold_timeout: Annotated[PositiveFloat, Field(le=86_400)] | None = None

    @field_validator("path")
    @classmethod
    def _path_starts_with_slash(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must start with '/' (got {v!r})")
        if not _PROBE_PATH.fullmatch(v):
            raise ValueError("must not contain control characters such as a newline")
        return v

    @field_validator("post_data", mode="before")
    @classmethod
    def _post_data_json(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"a string post_data must be JSON: {e.msg}") from None
            except RecursionError:
                raise ValueError(
                    f"a string post_data: the JSON is nested deeper than {MAX_NESTING_DEPTH} levels"
                ) from None
            if not isinstance(parsed, dict):
                raise ValueError("post_data must be a JSON object")
            problem = shape_error(parsed)
            if problem:
                raise ValueError(f"a string post_data: the JSON {problem}")
            return parsed
        return v

    @field_validator("headers")
    @classmethod
    def _sendable_headers(cls, v: dict[str, str]) -> dict[str, str]:
        # Checked here, after $VAR substitution: a header that cannot be sent would otherwise
        # fail every probe once initial_delay_seconds (20 minutes by default) had passed. The
        # value is never quoted (it may hold a secret).
        for name, value in v.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(
                    f"header {name[:80]!r}: not a header name (letters, digits and "
                    "!#$%&'*+-.^_`|~ only)"
                )
            if any(c in value for c in "\r\n\0") or not _latin1(value):
                raise ValueError(
                    f"header {name}: its value (after $VAR substitution) cannot be sent in an "
                    "HTTP head: a line break, a NUL or a character outside Latin-1"
                )
        return v

    @property
    def method(self) -> str:
        return "GET" if self.post_data is None else "POST"


# Prometheus' metric and label name rules (the exposition format).
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
MAX_METRIC_TARGETS = 8
MAX_METRIC_LABELS = 8
MAX_LATENCY_TARGET_MS = 3_600_000
# Metrics path: a URL path, no control characters, no whitespace (it goes into a request line).
_METRICS_PATH = re.compile(r"/[^\x00-\x20\x7f]{0,255}")


class MetricTarget(_Strict):
    """`replica_policy.target_metrics[i]`: a gauge the replicas export in Prometheus text
    (docs/autoscaling.md). The samples of `name` whose labels include all of `labels` are
    summed per replica; `target` is the value one replica should carry; `aggregation` says
    whether the fleet's mean or its busiest replica is held to it."""

    name: Annotated[str, Field(min_length=1, max_length=200)]
    labels: dict[str, Annotated[str, Field(max_length=200)]] = Field(default_factory=dict)
    target: PositiveFloat
    aggregation: Literal["mean", "max"] = "mean"

    @field_validator("name")
    @classmethod
    def _metric_name(cls, v: str) -> str:
        if not _METRIC_NAME.fullmatch(v):
            raise ValueError(
                f"{v[:60]!r} is not a Prometheus metric name (letters, digits, '_' and ':', "
                "not starting with a digit), e.g. vllm:num_requests_running"
            )
        return v

    @field_validator("labels")
    @classmethod
    def _label_names(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_METRIC_LABELS:
            raise ValueError(f"at most {MAX_METRIC_LABELS} labels to match (got {len(v)})")
        for key, value in v.items():
            if not _LABEL_NAME.fullmatch(key):
                raise ValueError(
                    f"{key[:60]!r} is not a Prometheus label name (letters, digits and '_', "
                    "not starting with a digit)"
                )
            if _not_text(value) or any(ord(c) < 0x20 for c in value):
                raise ValueError(f"the value of label {key!r} holds control characters")
        return v


class ReplicaPolicy(_Strict):
    min_replicas: ReplicaCount
    max_replicas: ReplicaCount | None = None
    target_qps_per_replica: PositiveFloat | dict[str, FiniteFloat] | None = None
    # fleetserve's extensions: scale on requests in flight (as Ray Serve does) and the length
    # of the request-rate window.
    target_ongoing_requests_per_replica: PositiveFloat | None = None
    qps_window_seconds: Annotated[PositiveFloat, Field(le=3600)] = 60.0
    num_overprovision: ReplicaCount | None = None
    upscale_delay_seconds: Seconds = DEFAULT_UPSCALE_DELAY_SECONDS
    downscale_delay_seconds: Seconds = DEFAULT_DOWNSCALE_DELAY_SECONDS
    base_ondemand_fallback_replicas: ReplicaCount = 0
    dynamic_ondemand_fallback: StrictBool = False
    # SkyServe's placer; `adaptive` is fleetserve's (docs/spot.md).
    spot_placer: Literal["dynamic_fallback", "adaptive"] | None = None
    # fleetserve: scale on what the replicas report (docs/autoscaling.md). The controller reads
    # `metrics_path` of each READY replica every `metrics_scrape_seconds`.
    # Requests waiting in the engine: grows the fleet while they stay above it; shrinks it only
    # when the running requests fit fewer replicas (fleetserve.policies.autoscaler).
    target_queue_per_replica: PositiveFloat | None = None
    target_kv_cache_usage: FiniteFloat | None = None  # the engine's KV cache use, in (0, 1]
    target_metrics: list[MetricTarget] | None = None
    metrics_scrape_seconds: Annotated[FiniteFloat, Field(ge=1, le=300)] = 5.0
    metrics_path: str = "/metrics"
    # ... and on the latency the load balancer measures, at `latency_percentile`: time to the
    # first byte of the answer (a streaming LLM server's TTFT), or the whole answer's.
    target_ttft_ms: Annotated[PositiveFloat, Field(le=MAX_LATENCY_TARGET_MS)] | None = None
    target_latency_ms: Annotated[PositiveFloat, Field(le=MAX_LATENCY_TARGET_MS)] | None = None
    latency_percentile: Annotated[FiniteFloat, Field(ge=50, le=99.9)] = 90.0

    @field_validator("target_kv_cache_usage")
    @classmethod
    def _kv_fraction(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(
                f"is the fraction of the KV cache in use, in (0, 1] (0.8 for 80%); got {v:g}"
            )
        return v

    @field_validator("target_metrics")
    @classmethod
    def _metric_targets(cls, v: list[MetricTarget] | None) -> list[MetricTarget] | None:
        if v is not None:
            if not v:
                raise ValueError("name at least one metric, or leave target_metrics out")
            if len(v) > MAX_METRIC_TARGETS:
                raise ValueError(f"at most {MAX_METRIC_TARGETS} metrics (got {len(v)})")
        return v

    @field_validator("metrics_path")
    @classmethod
    def _metrics_path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must start with '/' (got {v[:60]!r})")
        if not _METRICS_PATH.fullmatch(v):
            raise ValueError(
                "must be a URL path of at most 256 characters without spaces or control characters"
            )
        # It goes into the request line as it is: a character past ASCII cannot be sent (every
        # scrape would fail, the replicas read as missing forever), and a fragment is never sent.
        if not v.isascii():
            raise ValueError(f"must be ASCII; percent-encode other characters (got {v[:60]!r})")
        if "#" in v:
            raise ValueError(f"a URL fragment ('#') is never sent to the server (got {v[:60]!r})")
        return v

    @field_validator("target_qps_per_replica")
    @classmethod
    def _accelerator_targets(cls, v: Any) -> Any:
        if isinstance(v, dict):
            if not v:
                raise ValueError("a per-accelerator target must name at least one accelerator")
            for key, qps in v.items():
                if not _ACCELERATOR_KEY.fullmatch(key):
                    raise ValueError(f"key {key!r} must look like 'ACCELERATOR' or 'ACC:COUNT'")
                if qps <= 0:
                    raise ValueError(f"target for {key!r} must be > 0 (got {qps})")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaPolicy:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        if self.target_ttft_ms is not None and self.target_latency_ms is not None:
            raise ValueError(
                "set one latency target: target_ttft_ms (time to the first byte, for streaming "
                "answers) or target_latency_ms (the whole answer), not both"
            )
        if self.autoscaled:
            if self.max_replicas is None:
                raise ValueError(
                    f"max_replicas is required when {', '.join(self.targets_set())} is set"
                )
        elif self.max_replicas is not None and self.max_replicas != self.min_replicas:
            raise ValueError(
                f"without a target ({', '.join(AUTOSCALING_TARGETS)}) there is nothing to "
                f"autoscale on: max_replicas ({self.max_replicas}) must equal min_replicas "
                f"({self.min_replicas}) or be left out"
            )
        return self

    def targets_set(self) -> list[str]:
        """The autoscaling targets this policy sets, by key."""
        return [k for k in AUTOSCALING_TARGETS if getattr(self, k) is not None]

    @property
    def autoscaled(self) -> bool:
        return bool(self.targets_set())

    @property
    def scrapes_replicas(self) -> bool:
        """Whether the controller reads the replicas' metrics for this policy."""
        return (
            self.target_queue_per_replica is not None
            or self.target_kv_cache_usage is not None
            or self.target_metrics is not None
        )

    @property
    def latency_target_ms(self) -> float | None:
        return self.target_ttft_ms if self.target_ttft_ms is not None else self.target_latency_ms

    @property
    def effective_max(self) -> int:
        return self.min_replicas if self.max_replicas is None else self.max_replicas


# The keys that make a replica_policy autoscaled (any one of them needs max_replicas).
AUTOSCALING_TARGETS = (
    "target_qps_per_replica",
    "target_ongoing_requests_per_replica",
    "target_queue_per_replica",
    "target_kv_cache_usage",
    "target_metrics",
    "target_ttft_ms",
    "target_latency_ms",
)


class Tls(_Strict):
    keyfile: str
    certfile: str


class KvEventsOptions(_Strict):
    """`service.load_balancer.kv_events`: cache_aware's precise mode (docs/load-balancer.md).
    Each replica publishes its KV cache events (vLLM's `--kv-events-config`, ZMQ) on
    $FLEETSERVE_KV_EVENTS_PORT and answers replays on $FLEETSERVE_KV_EVENTS_REPLAY_PORT."""

    topic: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{0,100}$")] = "kv-events"
    # An engine sends nothing while idle: after this long without events the LB asks the
    # publisher for a replay; no answer within timeout_seconds: the approximate index.
    silence_seconds: Annotated[float, Field(ge=1, le=600)] = 10.0
    timeout_seconds: Annotated[float, Field(ge=0.1, le=60)] = 3.0
    # Bounds on what one replica's publisher may cost the LB (past them: the approximate
    # index for that replica, and a resubscription later).
    max_blocks: Annotated[int, Field(ge=1024, le=10_000_000)] = 131_072
    max_blocks_per_second: Annotated[int, Field(ge=100, le=10_000_000)] = 50_000
    max_message_bytes: Annotated[int, Field(ge=64 * 1024, le=64 * 1024 * 1024)] = 4 * 1024 * 1024


class LoadBalancerOptions(_Strict):
    """`service.load_balancer`: SkyServe's block (`stream_timeout_seconds`) with fleetserve's
    own options."""

    session_header: str | None = "X-Session-Id"  # sticky: the header that names a session
    session_cookie: str | None = None  # sticky: or a cookie
    prefix_chars: Annotated[int, Field(ge=1, le=100_000)] = 256  # prefix_affinity key length
    # prefix_affinity, cache_aware: a replica this many requests busier than the least loaded
    # one is passed over, whatever it holds. Unset: 4 for prefix_affinity, 8 for cache_aware
    # (LLM servers batch: a few more in flight cost less than a lost prefix; bench/llm).
    max_extra_load: Annotated[int, Field(ge=1, le=100_000)] | None = None
    # cache_aware (docs/load-balancer.md): the block size of the LB's prefix index, in
    # characters (~4 per token), and how many blocks it remembers per replica (2,048 x 256
    # characters, ~128K tokens): no fewer than the replica's KV cache holds, better several
    # times more (one that forgets sooner than the engine moves conversations away from their
    # history: bench/llm/results-2026-12-05c.md).
    cache_block_chars: Annotated[int, Field(ge=8, le=4096)] = 256
    cache_blocks: Annotated[int, Field(ge=16, le=1_000_000)] = 2048
    # cache_aware: how it chooses among the replicas within max_extra_load. "cost": the one
    # whose estimated wait for this prompt's first token is least, in prompt blocks (the
    # blocks it would prefill for it + cache_load_weight x (those it still prefills for
    # requests not yet answered + cache_decode_weight per request in flight)); "match": the
    # longest match (the rule before 2026-12-05); "owner": the longest match, ties to a keeper
    # (one replica per shared prefix, by a hash every LB process agrees on); "cost_owner":
    # cost, a prefix several replicas hold going to their keeper. docs/load-balancer.md.
    cache_choice: Literal["cost", "match", "owner", "cost_owner"] = "cost"
    cache_decode_weight: Annotated[float, Field(ge=0, le=1000)] = 1.0
    cache_load_weight: Annotated[float, Field(ge=0, le=1000)] = 0.25
    # cache_aware: log each choice with a prompt (one JSON line: each replica's matched blocks,
    # load, queued blocks and cost, and why the chosen one won) in the LB's log. A debug aid:
    # a line a request (docs/load-balancer.md).
    log_choices: bool = False
    # cache_aware: send each request's priority to the replica (vLLM's X-Vllm-Priority header,
    # read when the engine runs with --scheduling-policy priority): "uncached", the prompt
    # blocks the chosen replica lacks (fewest first); "deadline", now in ms plus
    # engine_priority_ms_per_block per such block; null: none. docs/load-balancer.md.
    engine_priority: Literal["uncached", "deadline"] | None = None
    engine_priority_ms_per_block: Annotated[float, Field(ge=0, le=60_000)] = 20.0

    @field_validator("engine_priority", mode="before")
    @classmethod
    def _priority_mode(cls, value: object) -> object:
        if isinstance(value, bool):  # YAML's off / no / false (on / yes / true)
            raise ValueError(
                "engine_priority is uncached, deadline or null; YAML reads off, no and false "
                "as a boolean: write null to send no hints"
            )
        return value

    # cache_aware: a request body up to this size is read before choosing (larger: its head).
    cache_max_body_bytes: Annotated[int, Field(ge=1024, le=256 * 1024)] = 256 * 1024
    # cache_aware: read each replica's Prometheus metrics this often (vLLM, SGLang and TGI
    # names for running + waiting requests) and count the larger of that and the LB's own
    # in-flight count as its load; unset: the LB's count only. (move_waiting_requests reads
    # them this often too, every 2 s when unset, without changing cache_aware's count.)
    replica_metrics_seconds: Annotated[float, Field(ge=0.1, le=60)] | None = None
    replica_metrics_path: Annotated[str, Field(pattern=r"^/[A-Za-z0-9._~/-]{0,200}$")] = "/metrics"
    # Any policy, for LLM servers: a request still waiting in a replica's queue (the replica's
    # metrics say it has waiting requests; the LB has no byte of its answer) is moved to a
    # replica with room, such as one just made READY (docs/load-balancer.md). It re-sends a
    # request the replica received: only for servers where that is harmless (an LLM server
    # aborts a request whose connection closes). Reads the metrics every
    # replica_metrics_seconds (unset: 2 s).
    move_waiting_requests: bool = False
    # cache_aware's precise mode: follow each replica's KV cache events (needs `tokenizer`,
    # the model folder, to tokenize prompts as the engine does; the `llm` extra).
    kv_events: KvEventsOptions | None = None
    tokenizer: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    connect_timeout_seconds: Annotated[float, Field(gt=0)] = 5.0
    read_timeout_seconds: Annotated[float, Field(gt=0)] = 600.0  # idle time between bytes
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    queue_size: Annotated[int, Field(ge=0)] = 256  # requests held while no replica is ready
    queue_timeout_seconds: Annotated[float, Field(ge=0)] = 300.0
    api_keys: list[Annotated[str, Field(min_length=16)]] = Field(default_factory=list, repr=False)
    workers: Annotated[int, Field(ge=1, le=64)] | None = None  # processes; default: cores, <= 4
    data_plane: Literal["python", "nginx"] = "python"  # nginx: the optional native data plane
    # What one client may cost the load balancer (python data plane; docs/load-balancer.md).
    max_header_bytes: Annotated[int, Field(ge=1024, le=1024 * 1024)] = 64 * 1024  # else 431
    max_header_count: Annotated[int, Field(ge=4, le=10_000)] = 100  # else 431
    max_url_bytes: Annotated[int, Field(ge=64, le=1024 * 1024)] = 8 * 1024  # else 414
    max_pipelined_requests: Annotated[int, Field(ge=1, le=1024)] = 16  # per connection
    # Client connections per LB process (past it: 503); default from RLIMIT_NOFILE, <= 10,000.
    max_connections: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    # ... and from one client address (past it: 503); unset: no per-client limit (behind a
    # proxy every client has the proxy's address).
    max_connections_per_client: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    header_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0  # a whole head; 408
    idle_timeout_seconds: Annotated[float, Field(gt=0, le=86_400)] = 75.0  # keep-alive, silent
    # SkyServe's name for the proxied response's timeout (httpx's per-read timeout there):
    # it sets read_timeout_seconds, which means the same here.
    stream_timeout_seconds: PositiveFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def _stream_timeout(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("stream_timeout_seconds") is None:
            return data
        stream, read = data["stream_timeout_seconds"], data.get("read_timeout_seconds")
        if read is None:
            return {**data, "read_timeout_seconds": stream}
        if read != stream:
            raise ValueError(
                "stream_timeout_seconds (SkyServe's name) and read_timeout_seconds are the same "
                "setting: set one of them"
            )
        return data

    # The address the endpoint binds (docs/security.md, exposing endpoints); default 127.0.0.1
    # on the local infra, 0.0.0.0 when replicas run on Ray (fleetserve.spec.exposure).
    host: str | None = None

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                ipaddress.ip_address(v)
            except ValueError:
                raise ValueError(f"{v!r} is not an IP address (0.0.0.0: every address)") from None
        return v


class Pool(_Strict):
    workers: ReplicaCount | None = None
    min_workers: ReplicaCount | None = None
    max_workers: ReplicaCount | None = None
    queue_length_threshold: Annotated[StrictCount, Field(ge=1)] | None = None
    upscale_delay_seconds: Seconds | None = None
    downscale_delay_seconds: Seconds | None = None

    @model_validator(mode="after")
    def _one_form(self) -> Pool:
        # SkyPilot's rules (sky/serve/service_spec.py, SkyServiceSpec, 0.14.1): a fixed size
        # (`workers`), or an autoscaled one (`max_workers`, from `min_workers`, else from
        # `workers`, else 1); `min_workers`, `queue_length_threshold` and the delays need
        # `max_workers`.
        if self.workers is None and self.min_workers is None and self.max_workers is None:
            raise ValueError(
                "set 'workers', or both 'min_workers' and 'max_workers' (to autoscale)"
            )
        if self.max_workers is None:
            for field in (
                "min_workers",
                "queue_length_threshold",
                "upscale_delay_seconds",
                "downscale_delay_seconds",
            ):
                if getattr(self, field) is not None:
                    raise ValueError(f"max_workers must be set when {field} is set")
        lo, hi = self.bounds()
        if hi < lo:
            which = "min_workers" if self.min_workers is not None else "workers"
            raise ValueError(f"{which} ({lo}) must be <= max_workers ({hi})")
        return self

    @property
    def autoscaled(self) -> bool:
        return self.max_workers is not None

    def bounds(self) -> tuple[int, int]:
        """(min, max) workers, as SkyPilot reads the section: with `max_workers` the pool
        autoscales from `min_workers` (else `workers`, else 1, SkyServe's default minimum)
        up to it; without, `workers` is its fixed size (and a `workers` beside both
        min_workers and max_workers is ignored, as there)."""
        if self.max_workers is None:
            n = self.workers or 0
            return n, n
        if self.min_workers is not None:
            return self.min_workers, self.max_workers
        return (self.workers if self.workers is not None else 1), self.max_workers


class ServiceSection(_Strict):
    readiness_probe: ReadinessProbe | None = None
    replicas: ReplicaCount | None = None
    replica_policy: ReplicaPolicy | None = None
    ports: Port | None = None
    load_balancing_policy: LbPolicy = DEFAULT_LB_POLICY
    tls: Tls | None = None
    pool: Pool | None = None
    load_balancer: LoadBalancerOptions = Field(default_factory=LoadBalancerOptions)
    # fleetserve's extension: replicas above the target while a rolling update overlaps
    # old and new versions (SkyServe's surge is unbounded).
    max_surge: Annotated[ReplicaCount, Field(ge=1)] = 1
    # ... and how many READY replicas the fleet may lack meanwhile (0: an old replica goes
    # only when a new one is READY in its place).
    max_unavailable: ReplicaCount = 0
    # fleetserve's extension: the longest a replica's launch (setup, then the start of run)
    # may take before it is FAILED_PROVISION; None: the controller's FLEETSERVE_LAUNCH_TIMEOUT.
    launch_timeout_seconds: Annotated[PositiveFloat, Field(le=7 * 24 * 3600)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_probe(cls, data: Any) -> Any:
        # SkyServe probes `/` when the YAML names no readiness_probe (pools probe nothing).
        if isinstance(data, dict) and data.get("readiness_probe") is None and not data.get("pool"):
            return {**data, "readiness_probe": "/"}
        return data

    @field_validator("readiness_probe", mode="before")
    @classmethod
    def _probe_shorthand(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _rules(self) -> ServiceSection:
        if self.replicas is not None and self.replica_policy is not None:
            raise ValueError("set either 'replicas' or 'replica_policy', not both")
        if self.pool is not None:
            for field in ("replica_policy", "ports"):
                if getattr(self, field) is not None:
                    raise ValueError(f"a pool cannot have '{field}'")
        elif self.readiness_probe is None:
            raise ValueError("'readiness_probe' is required (a path such as /health)")
        target = self.replica_policy.target_qps_per_replica if self.replica_policy else None
        instance_aware = self.load_balancing_policy == "instance_aware_least_load"
        if isinstance(target, dict) and not instance_aware:
            raise ValueError(
                "a per-accelerator target_qps_per_replica requires "
                "load_balancing_policy: instance_aware_least_load"
            )
        lb = self.load_balancer
        if lb.kv_events is not None and self.load_balancing_policy != "cache_aware":
            raise ValueError(
                "load_balancer.kv_events (cache_aware's precise mode) requires "
                "load_balancing_policy: cache_aware"
            )
        if lb.kv_events is not None and lb.tokenizer is None:
            raise ValueError(
                "load_balancer.kv_events needs load_balancer.tokenizer: the model's folder "
                "(tokenizer.json and its chat template), to tokenize prompts as the engine does"
            )
        if lb.kv_events is not None and lb.data_plane == "nginx":
            raise ValueError("load_balancer.kv_events needs data_plane: python")
        if lb.log_choices and (
            self.load_balancing_policy != "cache_aware" or lb.data_plane == "nginx"
        ):
            raise ValueError(
                "load_balancer.log_choices logs cache_aware's choices: it needs "
                "load_balancing_policy: cache_aware and data_plane: python"
            )
        if lb.engine_priority is not None and (
            self.load_balancing_policy != "cache_aware" or lb.data_plane == "nginx"
        ):
            raise ValueError(
                "load_balancer.engine_priority sends cache_aware's estimate of each prompt's "
                "uncached blocks: it needs load_balancing_policy: cache_aware and "
                "data_plane: python"
            )
        if lb.move_waiting_requests and lb.data_plane == "nginx":
            raise ValueError("load_balancer.move_waiting_requests needs data_plane: python")
        if lb.move_waiting_requests and lb.max_attempts < 2:
            raise ValueError(
                "load_balancer.move_waiting_requests needs max_attempts >= 2 (a move sends "
                f"a request again), got {lb.max_attempts}"
            )
        if instance_aware and not isinstance(target, dict):
            raise ValueError(
                "load_balancing_policy instance_aware_least_load requires target_qps_per_replica "
                "as a per-accelerator dict, e.g. {A100: 10, L4: 2}"
            )
        return self

    def replica_bounds(self) -> tuple[int, int]:
        """(min, max) replicas: `replicas: N` is N..N; neither field means 1..1 (SkyServe)."""
        if self.replica_policy is not None:
            return self.replica_policy.min_replicas, self.replica_policy.effective_max
        n = 1 if self.replicas is None else self.replicas
        return n, n

    def fleet_bounds(self) -> tuple[int, int]:
        """(min, max) of the fleet: a pool's workers, else the service's replicas."""
        return self.pool.bounds() if self.pool is not None else self.replica_bounds()


def _count_ports(ports: int | str | list[int | str] | None) -> int:
    if ports is None:
        return 0
    items = ports if isinstance(ports, list) else [ports]
    total = 0
    for item in items:
        if isinstance(item, int):
            total += 1
            continue
        m = _PORT_RANGE.fullmatch(item.strip())
        assert m is not None  # checked by the validator
        lo, hi = int(m.group(1)), int(m.group(3) or m.group(1))
        total += hi - lo + 1
    return total


class ResourcesBase(_Strict):
    """One set of resources. Cloud-only fields are accepted (files stay SkyServe-compatible)
    and ignored by the local infra."""

    infra: str | None = None
    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    cpus: StrictInt | FiniteFloat | str | None = None
    memory: StrictInt | FiniteFloat | str | None = None
    accelerators: str | list[str] | dict[str, StrictInt | FiniteFloat | None] | None = None
    accelerator_args: dict[str, Any] | None = None
    instance_type: str | None = None
    use_spot: StrictBool | None = None
    job_recovery: str | dict[str, Any] | None = None
    spot_recovery: str | None = None
    disk_size: StrictInt | str | None = None
    disk_tier: str | None = None
    network_tier: str | None = None
    ports: Port | str | list[Port | str] | None = None
    labels: dict[str, str] | None = None
    image_id: str | dict[str, str] | None = None
    autostop: StrictBool | StrictInt | dict[str, Any] | None = None
    priority: StrictInt | None = None
    priority_class: str | None = None
    max_hourly_cost: PositiveFloat | None = None
    local_disk: str | None = None
    ephemeral_storage: StrictInt | str | None = None  # SkyPilot's deprecated disk_size
    volumes: list[dict[str, Any]] | None = None

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: Any) -> Any:
        if isinstance(v, str) and not _CPUS.fullmatch(v.strip()):
            raise ValueError(f"must be a number, optionally followed by '+' (got {v!r})")
        if isinstance(v, int | float) and v <= 0:
            raise ValueError(f"must be > 0 (got {v})")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: Any) -> Any:
        if isinstance(v, str) and not _MEMORY.fullmatch(v.strip()):
            raise ValueError(
                f"must be a size in GB such as 16 or '32+', or a multiple of the vCPUs such as "
                f"'4x' (got {v!r})"
            )
        if isinstance(v, int | float) and v <= 0:
            raise ValueError(f"must be > 0 (got {v})")
        return v

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: Any) -> Any:
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, str):
                m = _PORT_RANGE.fullmatch(item.strip())
                if not m:
                    raise ValueError(f"{item!r} is not a port or a range such as '8000-8010'")
                lo, hi = int(m.group(1)), int(m.group(3) or m.group(1))
                if not 1 <= lo <= hi <= 65535:
                    raise ValueError(f"{item!r} must lie within 1..65535, low to high")
        return v

    @property
    def port_count(self) -> int:
        return _count_ports(self.ports)

    def single_port(self) -> int | None:
        if self.port_count != 1 or self.ports is None:
            return None
        item = self.ports[0] if isinstance(self.ports, list) else self.ports
        return int(str(item).split("-")[0])


class Resources(ResourcesBase):
    any_of: list[ResourcesBase] | None = None
    ordered: list[ResourcesBase] | None = None

    @model_validator(mode="after")
    def _alternatives(self) -> Resources:
        if self.any_of is not None and self.ordered is not None:
            raise ValueError("set either 'any_of' or 'ordered', not both")
        return self

    def candidates(self) -> list[ResourcesBase]:
        """Each alternative with the shared fields filled in (the resources alone if none)."""
        alternatives = self.any_of or self.ordered
        base = self.model_dump(exclude={"any_of", "ordered"}, exclude_none=True)
        if not alternatives:
            return [ResourcesBase(**base)]
        return [ResourcesBase(**{**base, **a.model_dump(exclude_none=True)}) for a in alternatives]


EnvValue = str | int | FiniteFloat | bool | None


class WorkdirGit(_Strict):
    """`workdir: {url, ref}`: a git repository (SkyPilot's form) instead of a folder."""

    url: Annotated[str, Field(min_length=1)]
    ref: str | None = None


class ServiceTask(_Strict):
    """A whole service YAML: task fields plus the `service:` section."""

    name: str | None = None
    workdir: str | WorkdirGit | None = None
    num_nodes: Annotated[StrictCount, Field(ge=1)] = 1
    resources: Resources = Field(default_factory=Resources)
    envs: dict[str, EnvValue] = Field(default_factory=dict)
    secrets: dict[str, EnvValue] = Field(default_factory=dict)
    # SkyPilot's list form of `secrets` (and `managed_secrets`): names of secrets kept by its
    # API server. fleetserve has no secret store; compat.compat_errors refuses them at `up`.
    managed_secrets: list[str | dict[str, Any]] | None = None
    setup: str | None = None
    run: str | None = None
    file_mounts: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    service: ServiceSection
    config: dict[str, Any] | None = None
    event_callback: str | None = None
    inputs: dict[str, Any] | None = None
    outputs: dict[str, Any] | None = None
    volumes: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = None
    pool: Pool | None = None  # SkyPilot's top-level pool section (pools are not run yet)
    api_server_access: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _secret_list(cls, data: Any) -> Any:
        # `secrets: [NAME, ...]` (SkyPilot's list form) names managed secrets, not values.
        if isinstance(data, dict) and isinstance(data.get("secrets"), list):
            refs = [*(data.get("managed_secrets") or []), *data["secrets"]]
            return {**data, "secrets": {}, "managed_secrets": refs}
        return data

    @field_validator("name")
    @classmethod
    def _task_name(cls, v: str | None) -> str | None:
        if v is not None and not _TASK_NAME.fullmatch(v):
            raise ValueError(
                "must be letters and digits, joined by one or two of '.', '_' and '-' "
                "(SkyPilot's task name rule)"
            )
        return v

    @field_validator("envs", "secrets")
    @classmethod
    def _env_names(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        for key in v:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return v

    @model_validator(mode="after")
    def _task_rules(self) -> ServiceTask:
        candidates = self.resources.candidates()
        spot = {bool(c.use_spot) for c in candidates}
        if len(spot) > 1:
            raise ValueError(
                "resources: every alternative must be spot (use_spot: true) or every one "
                "on-demand; mixing them is not supported"
            )
        uses_spot = spot == {True}
        policy = self.service.replica_policy
        if policy is not None and not uses_spot:
            if policy.base_ondemand_fallback_replicas > 0 or policy.dynamic_ondemand_fallback:
                raise ValueError(
                    "service.replica_policy: base_ondemand_fallback_replicas and "
                    "dynamic_ondemand_fallback need spot resources (resources.use_spot: true)"
                )
            if policy.spot_placer is not None:
                raise ValueError(
                    "service.replica_policy.spot_placer needs spot resources "
                    "(resources.use_spot: true)"
                )
        if self.service.ports is None and any(c.port_count > 1 for c in candidates):
            raise ValueError(
                "resources.ports exposes more than one port: set service.ports to the one the "
                "load balancer should send traffic to"
            )
        return self

    @property
    def uses_spot(self) -> bool:
        return bool(self.resources.candidates()[0].use_spot)

    def accelerator(self) -> str | None:
        """The accelerator a replica of this spec has, when every candidate names the same one
        (what instance-aware policies weigh it by)."""
        names = set()
        for c in self.resources.candidates():
            acc = c.accelerators
            if isinstance(acc, dict | list):
                names |= set(acc)
            elif isinstance(acc, str):
                names.add(acc)
        return names.pop().split(":")[0] if len(names) == 1 else None

    def replica_port(self) -> int | None:
        """The port a replica must listen on, when the YAML fixes one; None means 'any'."""
        if self.service.ports is not None:
            return self.service.ports
        ports = {c.single_port() for c in self.resources.candidates()}
        ports.discard(None)
        return ports.pop() if len(ports) == 1 else None

    def requested_infra(self) -> str | None:
        """The fleetserve infra (local, ray) the YAML asks for; a cloud's name is not one
        (compat.compat_warnings says so)."""
        infras = {
            c.infra
            for c in self.resources.candidates()
            if c.infra and c.infra.split("/")[0] in FLEETSERVE_INFRAS
        }
        return infras.pop() if len(infras) == 1 else None
