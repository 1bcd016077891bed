"""The project is a package: a wheel carries the library, the app and the shipped artefacts."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from scdviz import settings


def test_wheel_holds_the_app_the_cli_and_the_shipped_artefacts(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(settings.REPO_DIR)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("scdviz-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("scdviz/__main__.py", "scdviz/app/webapp.py", "scdviz/app/ui/scd_tab.py", "scdviz/models/hf.py",
                 "scdviz/assets/adapters/jargon/adapter_model.safetensors",
                 "scdviz/assets/scd/austen-before/calibration.safetensors",
                 "scdviz/assets/policy/per_head/best.safetensors", "scdviz/assets/text/jargon/eval.txt"):
        assert path in names, path
    shipped = {p.relative_to(settings.REPO_DIR / "assets").as_posix() for p in (settings.REPO_DIR / "assets").rglob("*")
               if p.is_file()}
    assert {f"scdviz/assets/{p}" for p in shipped} <= names  # every shipped file, nothing left behind
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "scdviz = scdviz.__main__:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any("tests/" in n or n.startswith("app.py") for n in names)
