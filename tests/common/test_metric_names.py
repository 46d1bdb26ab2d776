"""One definition of every metric name: ``cleave.common.metric_names``.

The runtime, the block store and the autoscaler register their metrics under its names; the
autoscaler's signals, its PromQL, the fakes and every test read them from it. These tests fail
when a metric is registered under another name (the autoscaler would look for one that no
longer exists), when a name is typed out anywhere else in the code (a copy a rename would
miss), or when the dashboards or the docs use a name that is not defined.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import REGISTRY

from cleave.common import metric_names as names

REPO = Path(__file__).resolve().parents[2]
DEFINITION = REPO / "common" / "cleave" / "common" / "metric_names.py"
# Where Cleave's Python lives (not the virtual environments beside it, which hold 50k files).
_SOURCES = ("common", "runtime", "kv_store", "autoscaling", "operator", "tests", "bench", "e2e",
            "tools", "docker", "examples")
_WORD = re.compile(r"\bcleave_[a-z0-9_]+|\bvllm:[a-z0-9_]+")  # Cleave's names and vLLM's
_SUFFIXES = ("", "_total", "_bucket", "_count", "_sum", "_created")


def _defined(word: str) -> bool:
    return any(word == name + suffix for name in names.ALL for suffix in _SUFFIXES)


def _mentions_a_metric(word: str) -> bool:
    """``word`` is a metric name, a sample of one, or a metric name cut short (a prefix an
    f-string completes): all copies of a name."""
    return _defined(word) or any(name.startswith(word) and word.endswith("_")
                                 for name in names.ALL)


def _python_files() -> Iterator[Path]:
    for root in _SOURCES:
        for path in (REPO / root).rglob("*.py"):
            if path != DEFINITION:
                yield path


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants: prose may name a metric."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _literals(path: Path) -> Iterator[tuple[int, str]]:
    """Every string literal of the module (f-string parts included), docstrings excepted."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and id(node) not in skip
                and isinstance(node.value, str | bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            yield node.lineno, text


def test_no_metric_name_is_typed_outside_its_definition() -> None:
    copies = [f"{path.relative_to(REPO)}:{line}: {word}"
              for path in _python_files() for line, text in _literals(path)
              for word in _WORD.findall(text) if _mentions_a_metric(word)]
    assert not copies, "import the name from cleave.common.metric_names:\n" + "\n".join(copies)


def test_the_processes_register_every_name_with_its_buckets() -> None:
    import cleave.autoscaling.metrics
    import cleave.kv_store.metrics
    from cleave.runtime import engine_metrics, metrics

    # vLLM's token-count buckets and the engine counters come with a worker's engine.
    engine_metrics._token_histograms(8192)
    engine_metrics._COUNTERS.read = lambda: engine_metrics.EngineCounts(0, 0, 0)
    engine_metrics.CACHE_CONFIG.labels("16", "float32", "True", "1", "0").set(1)
    registered = {family.name for family in REGISTRY.collect()}
    assert set(names.ALL) <= registered, set(names.ALL) - registered
    assert cleave.autoscaling.metrics.DESIRED is not None  # imported for what it registers
    assert cleave.kv_store.metrics.STORE_OP_SECONDS is not None
    for histogram, buckets in ((metrics.TTFT.ours, names.LATENCY_BUCKETS),
                               (metrics.TPOT.ours, names.TPOT_BUCKETS),
                               (metrics.E2E.ours, names.LATENCY_BUCKETS),
                               # vLLM's series keep vLLM's buckets: its dashboards' quantiles
                               (metrics.TTFT.theirs, names.VLLM_TTFT_BUCKETS),
                               (metrics.TPOT.theirs, names.VLLM_ITL_BUCKETS),
                               (metrics.E2E.theirs, names.VLLM_E2E_BUCKETS),
                               (engine_metrics.QUEUE_TIME.ours, names.LATENCY_BUCKETS),
                               (engine_metrics.QUEUE_TIME.theirs,
                                names.VLLM_REQUEST_TIME_BUCKETS),
                               (engine_metrics.DECODE_TIME, names.VLLM_REQUEST_TIME_BUCKETS),
                               (engine_metrics.PROMPT_LENGTH.ours, names.TOKEN_BUCKETS),
                               (engine_metrics.PROMPT_LENGTH.theirs,
                                names.vllm_token_buckets(8192)),
                               (engine_metrics.ITERATION_TOKENS,
                                names.VLLM_ITERATION_TOKEN_BUCKETS)):
        samples = next(iter(histogram.collect())).samples
        bounds = sorted({float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")})
        if bounds:  # a labelled histogram shows its buckets once a child exists
            assert tuple(bounds[:-1]) == buckets, histogram
        assert histogram._upper_bounds[:-1] == list(buckets), histogram  # type: ignore[attr-defined]


def test_dashboards_alerts_and_docs_use_defined_names() -> None:
    used = {(path.relative_to(REPO), word)
            for path in (REPO / "charts").rglob("*") if path.suffix in (".json", ".yaml", ".tpl")
            for word in _WORD.findall(path.read_text())}
    assert used, "the chart's dashboards name no cleave_ metric"
    unknown = sorted(f"{path}: {word}" for path, word in used if not _defined(word))
    assert not unknown, unknown
    documented = (REPO / "docs" / "metrics.md").read_text()
    assert not [n for n in names.ALL if n not in documented]
