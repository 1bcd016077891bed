"""Hosted mode over HTTP: every file the app writes lies under SCDVIZ_WORK, and no visitor's file is
served by its path (docs/hosting.md: gradio's temp files, exports and Chromium's profile used to land in the
home folder and the system's temporary folder, and another visitor's CSV was fetchable by path)."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from apprunner import running_app

pytestmark = pytest.mark.slow

P, J = "builtin:smollm2-135m", "builtin:jargon"


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()


def test_a_hosted_app_writes_only_under_its_work_folder_and_serves_no_folder_by_path(tmp_path):
    from gradio_client import Client

    from scdviz import settings

    home, system_tmp, work = tmp_path / "home", tmp_path / "tmp", tmp_path / "work"
    home.mkdir()
    system_tmp.mkdir()
    cache = settings.cache_dir()  # the built-in pair, read (and not written) by the app
    before = _files(cache)
    env = {"SCDVIZ_HOSTED": "1", "SCDVIZ_WORK": str(work), "SCDVIZ_CACHE": str(cache), "HOME": str(home),
           "TMPDIR": str(system_tmp), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": "", "XDG_CONFIG_HOME": "",
           "GRADIO_TEMP_DIR": ""}
    with running_app(tmp_path / "app.log", **env) as url:
        client = Client(url, verbose=False)
        client.predict(P, J, api_name="/load_pair")
        client.predict("The hacker's favourite editor is", 4, False, api_name="/generate")
        client.predict(["assets/scd/jargon/test.json"], api_name="/open_shipped")
        [page] = client.predict(api_name="/res_figures")
        assert os.path.getsize(page) < 10 * 2**20
        scratch = sorted(work.glob("sessions/*/scratch/results.csv"))
        assert scratch, sorted(str(p.relative_to(work)) for p in _files(work))
        for path in (scratch[0], *work.glob("sessions/*/scratch/figures-res/*")):
            with pytest.raises(urllib.error.HTTPError) as err:  # a session folder is never served by path
                urllib.request.urlopen(f"{url}gradio_api/file={path}", timeout=10)
            assert err.value.code == 403
        exported = [p for p in _files(work / "sessions") if "figures-res" in p.parts]
        assert sum(p.stat().st_size for p in exported) < 10 * 2**20  # one page, plotly.js once
        time.sleep(1)
    assert _files(home) == set(), sorted(map(str, _files(home)))[:10]
    assert _files(system_tmp) == set(), sorted(map(str, _files(system_tmp)))[:10]
    assert _files(cache) == before
    assert _files(work / "gradio")  # gradio's cache of served files is here, not in the system's tmp
