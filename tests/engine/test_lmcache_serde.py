"""The LMCache serde ``scd`` (scdviz.serving.lmcache_serde) round-trips a real SCD payload through LMCache's
``StorageManager`` and its filesystem L2 adapter, in the engine venv (lmcache 0.5.6 installed ``--no-deps``).

One held-out jargon prompt of 256 tokens (one LMCache chunk). A producer process (the built-in producer's weights)
computes its K / V, writes them into LMCache in LMCache's layout ``[2, layers, tokens, kv_heads * head_dim]``
(float32) under ``model_name = builtin:smollm2-135m``, ``cache_salt = scd-<calibration tag>-reuse4``, and LMCache's
store controller serializes the chunk into the L2 folder through the serde (the shipped jargon calibration's
REUSE-only plan at its operating point, int4 codes). A fresh consumer process (``builtin:jargon`` merged) prefetches
the key from L2, the serde decoding the payload into the specialist's own K / V. Asserted: the file holds the SCD
payload, byte for byte what ``Codec.encode_kv`` gives for the same chunk (not the raw KV); what LMCache hands back is
bitwise what ``Codec.decode`` gives on the stored bytes; the key of another calibration (austen-before's tag) misses,
and the payload filed under it is refused by the serde; the salt keeps LMCache's rules.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from scdviz import data
from scdviz.scd.calibration import Calibration
from scdviz.serving import models, setup_engine
from scdviz.settings import ASSETS_DIR, REPO_DIR

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not setup_engine.lmcache_ready(), reason=setup_engine.why_lmcache_not_ready())]

PROMPT = 256  # one LMCache chunk (its default chunk size)
CALIB, OTHER = ASSETS_DIR / "scd" / "jargon", ASSETS_DIR / "scd" / "austen-before"
PRODUCER = "builtin:smollm2-135m"
SHAPE = [2, 30, PROMPT, 3 * 64]  # K and V, layers, tokens, kv_heads * head_dim of the built-in pair


def side(name: str, job: dict, folder) -> dict:
    """One process of the engine venv: ``python -m scdviz.serving.lmcache_serde store|load``."""
    (folder / f"{name}.json").write_text(json.dumps(job))
    out, log = folder / f"{name}.pt", folder / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([str(setup_engine.python()), "-m", "scdviz.serving.lmcache_serde", name, "--job",
                               str(folder / f"{name}.json"), "--out", str(out)],
                              cwd=REPO_DIR, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert done.returncode == 0, f"{name} failed:\n" + "\n".join(log.read_text().splitlines()[-40:])
    result = torch.load(out)
    result["wall_seconds"] = time.perf_counter() - t0
    result["log"] = log.read_text()
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("lmcache")
    tokenizer = AutoTokenizer.from_pretrained(models.producer_folder())
    prompt = list(data.eval_windows(tokenizer, "jargon", "dev", PROMPT, 1)[0].ids)
    job = {"prompt": prompt, "calibration": str(CALIB), "other_calibration": str(OTHER), "fs": str(folder / "l2"),
           "producer": str(models.producer_folder()), "consumer": str(models.specialist_folder("jargon")),
           "shape": SHAPE, "dtype": "float32"}
    stored = side("store", job, folder)
    loaded = side("load", job, folder)
    return {"stored": stored, "loaded": loaded, "l2": folder / "l2", "tag": Calibration.load(CALIB).tag,
            "other_tag": Calibration.load(OTHER).tag}


def test_the_l2_holds_the_scd_payload_not_the_raw_kv(run):
    s = run["stored"]
    files = sorted(run["l2"].glob("*.data"))
    assert [f.name for f in files] == [run["loaded"]["stored_file"]] == list(s["files"])
    payload = s["direct_payload"]
    assert files[0].read_bytes() == payload  # byte for byte Codec.encode_kv of the same chunk
    assert s["raw_bytes"] == 2 * 30 * PROMPT * 192 * 4 and s["shape"] == SHAPE
    assert len(payload) < s["raw_bytes"] / 6  # int4 codes of ranks < 192, not 32-bit (or 16-bit) K / V
    print(f"\nL2 file {len(payload):,} B ({len(payload) / PROMPT:,.1f} B/token) for a chunk of {s['raw_bytes']:,} B "
          f"of float32 KV ({s['raw_bytes'] / PROMPT:,.0f} B/token; fp16 {s['raw_bytes'] / PROMPT / 2:,.0f}); store "
          f"process {s['wall_seconds']:.1f} s ({', '.join(f'{k} {v:.2f} s' for k, v in s['seconds'].items())})")


def test_what_lmcache_hands_back_is_codec_decode_of_the_payload(run):
    got, direct = run["loaded"]["loaded"], run["loaded"]["direct"]
    assert got is not None, "the consumer's prefetch missed the key:\n" + run["loaded"]["log"][-3000:]
    assert list(got.shape) == SHAPE and got.dtype == torch.float32
    diff = float((got - direct).abs().max())
    assert torch.equal(got, direct), f"max |difference| {diff:.3g}"  # bitwise: the same decode, the same bytes
    seconds = run["loaded"]["seconds"]
    print(f"\nloaded through LMCache == Codec.decode (max |difference| {diff}); load process "
          f"{run['loaded']['wall_seconds']:.1f} s ({', '.join(f'{k} {v:.2f} s' for k, v in seconds.items())})")


def test_a_key_of_another_calibration_misses(run):
    loaded = run["loaded"]
    assert loaded["other_salt"] == f"scd-{run['other_tag']:016x}-reuse4" != run["stored"]["salt"]
    assert loaded["other_miss"]  # nothing stored under austen-before's salt
    assert loaded["other_forged_refused"]  # jargon's payload filed under it: found by LMCache, refused by the serde
    assert "is not this serde's" in loaded["log"]
    assert not (run["l2"] / loaded["stored_file"].replace(run["stored"]["salt"], loaded["other_salt"])).exists()


def test_the_key_is_the_producer_and_a_salt_lmcache_accepts(run):
    stored = run["stored"]
    assert stored["model_name"] == PRODUCER
    salt = stored["salt"]
    assert salt == f"scd-{run['tag']:016x}-reuse4"
    assert len(salt) <= 128 and not set(salt) & set("@/\\\x00")
    assert run["loaded"]["stored_file"] == (f"{PRODUCER}@0x01000100@0@{run['loaded']['stored_file'].split('@')[3]}"
                                            f"@{salt}.data")  # LMCache's file name: model, rank, group, hash, salt
    rules = run["loaded"]["rules"]
    assert "must not contain '@'" in rules["docs_key"]  # docs/serving.md's old producer@calibration/plan
    assert "must not contain" in rules["slash_salt"] and "exceeds max length 128" in rules["long_salt"]
    assert rules["ours_slash"] and rules["ours_long"]  # lmcache_serde.check_salt refuses both, too
