"""``cleave bench``'s options checked and turned into its settings, before anything is sent.

Every duration is in seconds, as everywhere in ``cleave`` (``cleave up --ttft-slo 1.0``);
``--ttft-slo``/``--tpot-slo`` also take milliseconds written with a unit (``500ms``), and a
bare number so large it was surely meant in milliseconds (they were, before) gets a warning.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.runtime.loadgen.arrivals import ClosedLoop, OpenLoop, Schedule
from cleave.runtime.loadgen.report import Slo
from cleave.runtime.loadgen.workload import (
    LengthDist,
    SharedPrefix,
    Workload,
    load_prompts,
    parse_length,
)

if TYPE_CHECKING:  # the runner loads aiohttp: not for `cleave bench --help`
    from cleave.runtime.loadgen.runner import Limits

DEFAULT_BURSTINESS = 0.25
DEFAULT_NUM_REQUESTS = 100
DEFAULT_PROMPT_LEN = LengthDist(128, 128)
DEFAULT_PREFIX_LEN = 256  # tokens; vLLM's prefix_repetition default
# A bare SLO this many seconds or more was almost surely meant in milliseconds (the old unit).
LIKELY_MILLISECONDS = 50.0

_SECONDS = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(ms|s)?\s*$")


@dataclass(frozen=True)
class Settings:
    schedule: Schedule
    limits: Limits
    workload: Workload
    slo: Slo
    out: Path
    warmups: int = 0
    warnings: tuple[str, ...] = ()


def parse_seconds(option: str, text: str) -> tuple[float, str | None]:
    """``0.5``, ``0.5s`` or ``500ms`` -> (0.5, warning or None); ValueError naming the forms."""
    m = _SECONDS.match(text)
    if m is None:
        raise ValueError(f"{option} takes seconds (0.5, 0.5s) or milliseconds with the unit "
                         f"(500ms), not {text!r}")
    value = float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)
    if not value > 0:
        raise ValueError(f"{option} must be positive, not {text!r}")
    warning = None
    if m.group(2) is None and value >= LIKELY_MILLISECONDS:
        warning = (f"{option} is in seconds, as in cleave up (it was milliseconds before): "
                   f"{text} means {value:g} s; write {text}ms for milliseconds")
    return value, warning


def _slo(args: argparse.Namespace) -> tuple[Slo, tuple[str, ...]]:
    values: dict[str, float | None] = {}
    warnings: list[str] = []
    for name in ("ttft_slo", "tpot_slo"):
        text = getattr(args, name)
        values[name] = None
        if text is not None:
            values[name], warning = parse_seconds("--" + name.replace("_", "-"), text)
            if warning:
                warnings.append(warning)
    return Slo(values["ttft_slo"], values["tpot_slo"]), tuple(warnings)


def _schedule(args: argparse.Namespace) -> Schedule:
    if args.rate is None and (args.arrivals != "poisson" or args.burstiness is not None):
        raise ValueError("--arrivals and --burstiness shape the gaps of --rate; "
                         "they do not apply to --concurrency alone")
    if args.burstiness is not None and args.arrivals != "bursty":
        raise ValueError("--burstiness needs --arrivals bursty")
    if args.rate is not None:
        shape = (args.burstiness or DEFAULT_BURSTINESS) if args.arrivals == "bursty" else 1.0
        return OpenLoop(args.rate, shape, args.concurrency)
    return ClosedLoop(args.concurrency if args.concurrency is not None else 1)


def _workload(args: argparse.Namespace) -> Workload:
    shared = None
    if args.shared_prefix is not None:
        if args.prompts is not None:
            raise ValueError("--shared-prefix builds synthetic prompts; it does not apply to a "
                             "--prompts file")
        if args.prompt_len is not None:
            raise ValueError("with --shared-prefix the prompt is --prefix-len + --suffix-len "
                             "tokens: give the suffix with --suffix-len, not --prompt-len")
        shared = SharedPrefix(args.shared_prefix, DEFAULT_PREFIX_LEN if args.prefix_len is None
                              else args.prefix_len)
    elif args.prefix_len is not None or args.suffix_len is not None:
        raise ValueError("--prefix-len and --suffix-len need --shared-prefix N")
    if args.prompts is not None and args.prompt_len is not None:
        raise ValueError("--prompt-len is for synthetic prompts; a --prompts file sets its own")
    prompts = load_prompts(args.prompts, args.endpoint == "chat") if args.prompts else ()
    length = args.suffix_len if shared else args.prompt_len
    prompt_len = parse_length(length) if length else DEFAULT_PROMPT_LEN
    return Workload(parse_length(args.output_len), prompt_len, prompts, args.seed, shared)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Every option checked before anything is sent; raises ValueError with a clear message."""
    from cleave.runtime.loadgen.runner import Limits

    if not args.timeout > 0:
        raise ValueError(f"--timeout must be positive, not {args.timeout:g}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be 0 or more, not {args.num_warmups}")
    slo, warnings = _slo(args)
    num = args.num_requests
    if num is None and args.duration is None:
        num = DEFAULT_NUM_REQUESTS
    out = args.out or Path(time.strftime("cleave-bench-%Y%m%d-%H%M%S"))
    return Settings(_schedule(args), Limits(num, args.duration), _workload(args), slo, out,
                    args.num_warmups, warnings)
