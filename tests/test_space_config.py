"""The Hugging Face Space's configuration (README front matter + requirements.txt) is one ZeroGPU can build.

Fast tier, no models: it reads two files and compares versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# What ZeroGPU supports, from its docs (hub-docs spaces-zerogpu.md, "Supported versions"):
# Python 3.10 and 3.12; PyTorch 2.8 to 2.11, listed release by release. Update from there, not from here.
ZEROGPU_PYTHONS = ("3.10", "3.12")
ZEROGPU_TORCHES = ("2.8.0", "2.9.0", "2.9.1", "2.10.0", "2.11.0")


def front_matter(readme: str) -> dict:
    """The YAML block between the README's opening `---` lines (what the Hub reads)."""
    assert readme.startswith("---\n"), "README.md must open with the Space's YAML front matter"
    block, sep, _ = readme[4:].partition("\n---\n")
    assert sep, "README.md's front matter is not closed by a `---` line"
    meta = yaml.safe_load(block)
    assert isinstance(meta, dict), "README.md's front matter is not a mapping"
    return meta


def requirements(text: str) -> dict[str, Requirement]:
    """requirements.txt's requirements by (normalised) name; comments and blank lines dropped."""
    reqs = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            reqs[req.name.lower().replace("_", "-")] = req
    return reqs


def check_python(meta: dict) -> None:
    version = meta.get("python_version")
    # quoted on purpose: YAML reads an unquoted 3.10 as the float 3.1
    assert isinstance(version, str), f"python_version must be a quoted string, got {version!r}"
    assert version in ZEROGPU_PYTHONS, f"python_version {version!r} is not one ZeroGPU runs: {ZEROGPU_PYTHONS}"


def check_torch(reqs: dict[str, Requirement], installed: str) -> None:
    assert "torch" in reqs, "requirements.txt does not name torch"
    spec = reqs["torch"].specifier
    admitted = [v for v in ZEROGPU_TORCHES if spec.contains(v, prereleases=False)]
    assert admitted, f"torch{spec} admits none of ZeroGPU's PyTorch versions {ZEROGPU_TORCHES}"
    public = Version(installed).public  # 2.13.0+cpu -> 2.13.0
    assert spec.contains(public, prereleases=True), f"torch{spec} does not admit the installed torch {installed}"


def check_gradio(meta: dict, reqs: dict[str, Requirement]) -> None:
    assert meta.get("sdk") == "gradio", f"sdk is {meta.get('sdk')!r}; ZeroGPU runs only Gradio Spaces"
    assert "gradio" in reqs, "requirements.txt does not name gradio"
    pins = [s.version for s in reqs["gradio"].specifier if s.operator == "=="]
    assert len(pins) == 1, f"gradio must be pinned with == in requirements.txt, got gradio{reqs['gradio'].specifier}"
    assert str(meta.get("sdk_version")) == pins[0], (
        f"sdk_version {meta.get('sdk_version')!r} differs from requirements.txt's gradio=={pins[0]}"
    )


def check_app_file(meta: dict, root: Path) -> None:
    app_file = meta.get("app_file")
    assert isinstance(app_file, str) and app_file, "the front matter names no app_file"
    assert (root / app_file).is_file(), f"app_file {app_file!r} does not exist"


@pytest.fixture(scope="module")
def meta() -> dict:
    return front_matter((ROOT / "README.md").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def reqs() -> dict[str, Requirement]:
    return requirements((ROOT / "requirements.txt").read_text(encoding="utf-8"))


def test_python_version_is_one_zerogpu_runs(meta):
    check_python(meta)


def test_torch_requirement_admits_zerogpu_and_the_installed_torch(reqs):
    check_torch(reqs, torch.__version__)


def test_sdk_is_gradio_at_the_pinned_version(meta, reqs):
    check_gradio(meta, reqs)


def test_app_file_exists(meta):
    check_app_file(meta, ROOT)


# The checks above can fail: each refuses a configuration that ZeroGPU (or this checkout) would not accept.
@pytest.mark.parametrize("front", ['python_version: "3.11"', "python_version: 3.10", "python_version: 3.12", ""])
def test_a_python_zerogpu_lacks_is_refused(front):
    with pytest.raises(AssertionError, match="python_version"):
        check_python(front_matter(f"---\nsdk: gradio\n{front}\n---\n# x\n"))


@pytest.mark.parametrize(
    ("line", "installed"),
    [
        ("torch==2.13.0", "2.13.0+cpu"),  # no ZeroGPU version
        ("torch>=2.12", "2.13.0"),  # no ZeroGPU version
        ("torch>=2.8,<2.12", "2.13.0+cpu"),  # not the installed one
        ("torch==2.11.0", "2.13.0"),  # not the installed one
        ("numpy", "2.13.0"),  # no torch line at all
    ],
)
def test_a_torch_requirement_that_misses_either_is_refused(line, installed):
    with pytest.raises(AssertionError, match="torch"):
        check_torch(requirements(line), installed)


def test_a_torch_range_that_admits_both_passes():
    check_torch(requirements("torch>=2.8,<2.14  # a comment"), "2.13.0+cpu")
    check_torch(requirements("torch>=2.11"), "2.11.0+cu130")


@pytest.mark.parametrize(
    ("front", "pins"),
    [
        ("sdk: docker\nsdk_version: 6.31.0", "gradio==6.31.0"),
        ("sdk: gradio\nsdk_version: 6.30.0", "gradio==6.31.0"),
        ("sdk: gradio\nsdk_version: 6.31.0", "gradio>=6"),
        ("sdk: gradio\nsdk_version: 6.31.0", "numpy"),
    ],
)
def test_a_gradio_mismatch_is_refused(front, pins):
    with pytest.raises(AssertionError, match="sdk|gradio"):
        check_gradio(front_matter(f"---\n{front}\n---\n"), requirements(pins))


def test_a_missing_app_file_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="app_file"):
        check_app_file({"app_file": "app.py"}, tmp_path)
    with pytest.raises(AssertionError, match="app_file"):
        check_app_file({}, tmp_path)
    (tmp_path / "app.py").write_text("")
    check_app_file({"app_file": "app.py"}, tmp_path)
