"""Plans that persist: what the engine learnt about one request on one kind of device (JSON).

A ``Plan`` says which strategy runs a request's chunks and keeps, per strategy it has met, whether
it works and agrees with the eager reference, what compiling it cost, and its measured time and
peak memory as lines in chunk rows. It also keeps the checks ``build_problem`` made (so a later
job skips them) and how many compute seconds jobs under it have spent, which is what a strategy
trial may cost (see ``worker.engine.tuning``). It is keyed by a ``PlanKey``: model fingerprint,
signature, request, input shapes (batch size bucketed where examples are independent), device
kind and TensorFlow version; any change of these is another key, never a wrong plan.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from contracts.plans import PLAN_FORMAT, request_digest
from contracts.plans import digest as _digest
from worker.engine.planner import LinearFit, bucket_rows


def strategy_label(name: str, xla: bool) -> str:
    """``"vectorized", True`` -> ``"vectorized+xla"``."""
    return name + ("+xla" if xla else "")


def parse_label(label: str) -> tuple[str, bool]:
    """``"vectorized+xla"`` -> ``("vectorized", True)``."""
    name, _, flag = label.partition("+")
    return name, flag == "xla"


@dataclass(frozen=True)
class PlanKey:
    """What a plan depends on; ``digest`` names it in a cache."""

    model: str                                    # fingerprint of saved_model.pb and the variables index
    signature: str
    of: str
    wrt: str
    kind: str
    mode: str                                     # as requested ("auto" stays "auto")
    reduce: str | None
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]   # name, shape (batch bucketed), dtype
    device: str                                   # e.g. "CPU/Intel Xeon .../2" or "GPU/NVIDIA H100 .../cc9.0"
    tensorflow: str
    format: int = PLAN_FORMAT

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["inputs"] = [[n, list(s), d] for n, s, d in self.inputs]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanKey:
        inputs = tuple((str(n), tuple(int(d) for d in s), str(t)) for n, s, t in data["inputs"])
        return cls(**{**data, "inputs": inputs})

    @property
    def digest(self) -> str:
        return _digest(self.to_json())

    @property
    def family(self) -> str:
        """The same request on other input shapes: where a default strategy may come from."""
        return _digest({k: v for k, v in self.to_json().items() if k != "inputs"})

    @property
    def request(self) -> str:
        """The key without device and TensorFlow version: what the API finds a plan by (``contracts.plans``)."""
        return request_digest(self.to_json())


def batch_bucketed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with its leading (batch) dimension rounded up to a power of two."""
    return (bucket_rows(shape[0]),) + tuple(shape[1:]) if shape else shape


@dataclass
class StrategyRecord:
    """What is known of one strategy (``"tiled"``, ``"vectorized+xla"``, ...) for a plan's request."""

    status: str = "untried"          # "ok" | "failed" | "disagrees" | "too_much_memory" | "untried"
    reason: str | None = None
    verified: bool = False           # its rows matched the eager reference rows (at some chunk size)
    verified_rows: list[int] = field(default_factory=list)   # the chunk sizes whose rows were checked
    compile_s: float | None = None   # first call minus a steady call of its size (scaled per row from the next
                                     # size's where the ladder grew first; XLA: the larger of a trial's two sizes')
    kept_compile_s: float | None = None   # the same, its function loaded from a kept trace (``trace_cache``): what
                                          # TensorFlow does on a first call that no kept graph saves
    resize_s: float | None = None    # a new chunk size's first call minus a steady call of that size, its function
                                     # already called at another size in the process: what a doubling's first call
                                     # costs a strategy whose function takes any size (not XLA: ``compile_s``;
                                     # ``contracts.plan_predictions.new_size_cost``)
    compile_factor: float | None = None   # its compile as a multiple of ``tiled``'s, measured by a trial whose
                                          # compile exceeded the estimate (``worker.engine.tuning.learned_factor``)
    memory: LinearFit | None = None  # peak bytes of a chunk, in rows: at or above every measured peak
    seconds: LinearFit | None = None  # seconds of a chunk, in rows
    rates: dict[int, float] = field(default_factory=dict)   # rows/s measured per chunk size (the sizes timed)
    peaks: dict[int, int] = field(default_factory=dict)     # the largest peak bytes measured per chunk size
    last_peaks: dict[int, int] = field(default_factory=dict)  # the latest job's peak per size (what a quote says)
    preferred_rows: int | None = None  # the chunk size kept: the last doubling that bought rows/s
    batch: int | None = None         # the batch size the fits were measured at
    peak_unseen: bool = False        # its chunks' peaks read 0: the allocator statistics do not see its memory
                                     # (XLA on the CPU), so a memory budget cannot bound it
    comparing: list[Any] | None = None   # an undecided doubling, for the next job: [small, large, pairs(, waiting)]
    peak_measure: str = "allocator"   # what ``peaks`` and ``memory`` count: TensorFlow's "allocator" bytes, or
                                      # "process_rss" (a host job's VmHWM delta over a chunk, where they miss it)

    @property
    def usable(self) -> bool:
        return self.status in ("ok", "untried")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory"] = None if self.memory is None else [self.memory.fixed, self.memory.per_row]
        out["seconds"] = None if self.seconds is None else [self.seconds.fixed, self.seconds.per_row]
        out["rates"] = {str(k): v for k, v in self.rates.items()}
        out["peaks"] = {str(k): v for k, v in self.peaks.items()}
        out["last_peaks"] = {str(k): v for k, v in self.last_peaks.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StrategyRecord:
        memory, seconds = data.get("memory"), data.get("seconds")
        return cls(status=data.get("status", "untried"), reason=data.get("reason"),
                   verified=bool(data.get("verified")), compile_s=data.get("compile_s"),
                   kept_compile_s=data.get("kept_compile_s"), resize_s=data.get("resize_s"),
                   compile_factor=data.get("compile_factor"),
                   verified_rows=[int(k) for k in data.get("verified_rows") or []],
                   memory=None if memory is None else LinearFit(float(memory[0]), float(memory[1])),
                   seconds=None if seconds is None else LinearFit(float(seconds[0]), float(seconds[1])),
                   rates={int(k): float(v) for k, v in (data.get("rates") or {}).items()},
                   peaks={int(k): int(v) for k, v in (data.get("peaks") or {}).items()},
                   last_peaks={int(k): int(v) for k, v in (data.get("last_peaks") or {}).items()},
                   preferred_rows=data.get("preferred_rows"), batch=data.get("batch"),
                   peak_unseen=bool(data.get("peak_unseen")), comparing=_comparing(data.get("comparing")),
                   peak_measure=str(data.get("peak_measure") or "allocator"))

    def memory_at(self, batch: int | None) -> LinearFit | None:
        """The memory line for ``batch`` examples: scaled up from the batch it was measured at."""
        if self.memory is None or not batch or not self.batch or batch <= self.batch:
            return self.memory
        scale = batch / self.batch
        return LinearFit(self.memory.fixed * scale, self.memory.per_row * scale)

    def best_rate(self) -> float | None:
        return max(self.rates.values()) if self.rates else None


def _comparing(raw: Any) -> list[Any] | None:
    """A stored open comparison, ``[small, large, pairs]`` and a ``small`` timing waiting for its partner where one
    does, or None when it is malformed (a plan is advice: never an error)."""
    try:
        small, large, pairs, *waiting = raw
        carried = [int(small), int(large), [[float(a), float(b)] for a, b in pairs]]
        if len(waiting) > 1:
            return None
        return carried + [float(w) for w in waiting]
    except (TypeError, ValueError):
        return None


@dataclass
class Plan:
    """The strategy a request runs with and what was learnt about it; see the module docstring.

    ``source`` says where the strategy came from: ``default`` (by kind and model structure, or a
    similar request's choice), ``cache`` (a stored plan), ``trial`` (chosen by an interleaved
    comparison in this run) or ``pinned`` (asked for by the caller).
    """

    strategy: str
    key: PlanKey | None = None
    source: str = "default"
    strategies: dict[str, StrategyRecord] = field(default_factory=dict)
    checked: dict[str, Any] | None = None
    refined: bool = False            # every alternative worth a trial was tried, or ruled out
    work_s: float = 0.0              # compute seconds of every job run under this plan
    jobs: int = 0
    updated_at: float = field(default_factory=time.time)

    def record(self, label: str) -> StrategyRecord:
        if label not in self.strategies:
            self.strategies[label] = StrategyRecord()
        return self.strategies[label]

    @property
    def current(self) -> StrategyRecord:
        return self.record(self.strategy)

    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "strategy": self.strategy, "source": self.source,
                "key": None if self.key is None else self.key.to_json(),
                "strategies": {k: v.to_json() for k, v in self.strategies.items()},
                "checked": self.checked, "refined": self.refined, "work_s": round(self.work_s, 6),
                "jobs": self.jobs, "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """Raises ``ValueError`` for a plan of another format (callers treat it as a miss)."""
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {data.get('format')!r} is not {PLAN_FORMAT}")
        key = data.get("key")
        return cls(strategy=str(data["strategy"]), source=str(data.get("source", "cache")),
                   key=None if key is None else PlanKey.from_json(key),
                   strategies={k: StrategyRecord.from_json(v) for k, v in (data.get("strategies") or {}).items()},
                   checked=data.get("checked"), refined=bool(data.get("refined")),
                   work_s=float(data.get("work_s") or 0.0), jobs=int(data.get("jobs") or 0),
                   updated_at=float(data.get("updated_at") or time.time()))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def loads(cls, text: str | bytes) -> Plan:
        return cls.from_json(json.loads(text))
