"""The images install what `make images` checked (tools/check_images.py reads each Dockerfile's
extra; these tests check the rest of each Dockerfile and the extras themselves). No container
engine is needed."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cleave.common.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_images  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
TORCH_PIN = "torch==2.13.0"


def _name(requirement: str) -> str:
    return re.split(r"[\[=<>~!; ]", requirement, maxsplit=1)[0].lower()


def resolved(extra: str) -> set[str]:
    """The packages an extra brings, its `cleave[...]` self-references followed, plus the base."""
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for requirement in EXTRAS[extra]:
        if (self_ref := re.fullmatch(r"cleave\[([\w,]+)\]", requirement)) is not None:
            for inner in self_ref.group(1).split(","):
                names |= resolved(inner)
        else:
            names.add(_name(requirement))
    return names


def test_every_dockerfile_is_an_image_the_import_check_runs() -> None:
    checked = {image.dockerfile for image in check_images.IMAGES if image.dockerfile}
    assert {str(p.relative_to(ROOT)) for p in DOCKERFILES} == checked


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.stem)
def test_a_dockerfile_installs_the_project_with_one_extra_of_pyproject(dockerfile: Path) -> None:
    extra, _ = check_images.dockerfile_installs(dockerfile)
    assert extra in EXTRAS
    text = dockerfile.read_text()
    assert "--no-deps ." not in text, "the project comes with its extra, not without deps"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.stem)
def test_a_dockerfile_copies_every_package_folder_the_wheel_is_built_from(dockerfile: Path
                                                                          ) -> None:
    packages = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile.read_text(), re.MULTILINE))
    assert {p.split("/")[0] for p in packages} <= copied
    assert "pyproject.toml" in copied


def test_the_operator_extra_has_no_model_stack_and_the_runtime_serves_the_router() -> None:
    assert not resolved("operator") & {"torch", "transformers", "accelerate", "redis"}
    assert not resolved("router") & {"torch", "kopf", "kubernetes"}
    assert not resolved("runtime") & {"kopf", "kubernetes"}
    assert resolved("router") <= resolved("runtime")
    images = {check_images.extra_of(image)[0] for image in check_images.IMAGES}
    assert images == {"operator", "runtime", "router"}
    # `make setup` installs dev: every image's extra, so local behaviour is all of them.
    assert {e for e in EXTRAS if e != "dev"} <= set(
        re.fullmatch(r"cleave\[([\w,]+)\]", EXTRAS["dev"][0]).group(1).split(","))  # type: ignore[union-attr]


def test_every_subcommand_names_an_extra_that_exists() -> None:
    assert {c.extra for c in COMMANDS} <= set(EXTRAS)


def test_torch_is_pinned_everywhere_it_is_installed() -> None:
    requirements = [*PYPROJECT["project"]["dependencies"],
                    *(r for extra in EXTRAS.values() for r in extra)]
    assert [r for r in requirements if _name(r) == "torch"] == [TORCH_PIN]
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text().replace("\\\n", " ")
        for command in re.findall(r"pip install ([^&\n]*)", text):
            words = [w.strip("'\"") for w in command.split()]
            torch = [w for w in words if w.startswith("torch")]
            assert all(w == TORCH_PIN for w in torch), f"{dockerfile.name}: {command}"


def test_the_runtime_image_takes_the_pinned_torch_from_the_variant_its_build_arg_names(
        ) -> None:
    text = (ROOT / "docker/runtime.Dockerfile").read_text().replace("\\\n", " ")
    assert re.search(r"^ARG TORCH=cpu$", text, re.MULTILINE)
    install = re.search(r"pip install [^&]*--index-url \"https://download.pytorch.org/whl/"
                        r"\$\{TORCH\}\"\s+(\S+)", text)
    assert install is not None and install.group(1) == TORCH_PIN
    # torch first: the extra's own pin is then met by the variant already installed.
    assert text.index(TORCH_PIN) < text.index("'.[runtime]'")


def test_the_default_model_wheel_is_the_one_make_setup_installs() -> None:
    _, wheels = check_images.dockerfile_installs(ROOT / "docker/runtime.Dockerfile")
    makefile = (ROOT / "Makefile").read_text()
    assert wheels and all(wheel in makefile for wheel in wheels)


def test_make_test_runs_the_image_check(tmp_path: Path) -> None:
    """What `make test` would run (make -n: recursive makes print theirs too), whatever the
    Makefile's structure: the image check, mypy and the suite among it. Its side log goes
    elsewhere: a `make test` may be running this very test, writing its own."""
    planned = subprocess.run(["make", "-n", "test", f"SIDE_LOG={tmp_path / 'side.log'}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    for command in ("tools/check_images.py", "bin/mypy", "bin/pytest", "bin/ruff check"):
        assert command in planned.stdout, (command, planned.stdout)
