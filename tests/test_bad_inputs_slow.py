"""The catalogue of bad inputs: every row sent over HTTP to a running app gets a specific message.

Two apps run on the built-in pair: one hosted (``SCDVIZ_HOSTED=1``, the public demo) and
one local. Each row names the endpoint (the UI's events, as an API client or a browser
sends them), the inputs, the app it runs against and a fragment the message must contain.
No row may reach "internal error" or a traceback, and each answer comes within seconds
because every check happens before model work starts.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from apprunner import running_app

pytestmark = pytest.mark.slow

P, J, B = "builtin:smollm2-135m", "builtin:jargon", "builtin:austen-before"
BIG = "x" * 4_000_000  # a 4 MB prompt: refused on length before any tokenizer sees it
LONG_TOKENS = "the " * 1100  # ~1,100 tokens in ~4,400 characters: under the character cap, over the token cap
CTX = ("The quick brown fox jumps over the lazy dog while the farmer watches from the gate and the children "
       "laugh in the orchard under the old apple trees. ") * 6  # ~180 tokens
# the arguments by position, named as the request's fields (the endpoint's parameters, in order; trailing ones may be
# left to their defaults): test_the_arguments_follow_the_request_fields keeps them so
SCD = dict(text=None, continuation_tokens=32, generated_tokens=8, bits="4", rank_k=0, rank_v=0, patch_layers=2,
           placement="selected", manual_layers="", bandwidth_gbps=10, latency_ms=0.5, fan_out=False, byte_budget=0,
           coder="transform", recompute_tail=0)
EV = dict(context=CTX, question="", question_aware=False, budget_unit="% kept", budget=25, model="producer",
          method="distilled-scorer", methods=None)
CAL = dict(domains=["jargon"], fit_windows=4, select_windows=1, rate_windows=0, patch_layers=2, bits="4",  # hosted caps
           name="bad-input-run")
TR = dict(steps=10, contexts=2, per_head=True, name="bad-input-policy")
DI = dict(train_windows=2, val_windows=1, epochs=2, val_every=0, rank=32, recall=0.1, recall_target="quote",
          budgets=True, name="bad-input-distil")


def _call(endpoint, defaults, kw):
    assert set(kw) <= set(defaults), set(kw) - set(defaults)  # a misspelt field would be sent as an extra argument
    return (endpoint, tuple({**defaults, **kw}.values()))


def scd(**kw):
    return _call("/scd_transfer", SCD, kw)


def ev(**kw):
    return _call("/evict", EV, kw)


def cal(**kw):
    return _call("/calibrate", CAL, kw)


def tr(**kw):
    return _call("/train", TR, kw)


def di(**kw):
    return _call("/distil", DI, kw)


# (mode, (endpoint, args), expected fragment); mode: "both", "hosted", "local", or "nopair" (a fresh visitor)
ROWS = [
    # ---- Pair tab: sources
    ("both", ("/load_pair", ("", J)), "choose a producer"),
    ("both", ("/load_pair", (P, "  ")), "choose a consumer"),
    ("both", ("/load_pair", (P, "builtin:/etc")), "unknown built-in model '/etc'"),
    ("both", ("/load_pair", (P, "builtin:../../../..")), "unknown built-in model"),
    ("both", ("/load_pair", ("builtin:../adapters/jargon", J)), "unknown built-in model"),
    ("both", ("/load_pair", (P, "builtin:nope")), "unknown built-in model 'nope'"),
    ("both", ("/load_pair", (P, "org/" + "y" * 400)), "at most 300 characters"),
    ("hosted", ("/load_pair", ("/etc", J)), "local folders are not available"),
    ("hosted", ("/load_pair", (P, "../../models")), "local folders are not available"),
    ("hosted", ("/load_pair", (P, "~/models")), "local folders are not available"),
    ("hosted", ("/load_pair", (P, "someorg/some-model")), "allow-list"),
    ("hosted", ("/load_pair", (P, "builtin:gemma3-270m")), "runs in a local install"),
    ("local", ("/load_pair", (P, "/nonexistent/folder")), "not a model folder"),
    ("local", ("/load_pair", (P, "{empty}")), "not a model folder"),
    ("local", ("/load_pair", (P, "{lora_other}")), "does not fit its base model"),
    ("local", ("/load_pair", (P, "{tiny}")), "incompatible pair"),
    ("local", ("/load_pair", (P, "{broken_model}")), "could not load"),
    ("local", ("/load_pair", (P, "nobody-xyz/not-a-model-1234")), "offline"),
    ("local", ("/load_pair", (P, "no spaces/allowed here!")), "neither a built-in name"),
    # ---- Pair tab: generate
    ("nopair", ("/generate", ("Hello there", 8, False)), "load a pair first"),
    ("both", ("/generate", ("   ", 8, False)), "the prompt is empty"),
    ("both", ("/generate", ("", 8, False)), "the prompt is empty"),
    ("both", ("/generate", (BIG, 8, False)), "4,000,000 characters"),
    ("both", ("/generate", ("a", 8, False)), "at least 2 tokens"),
    ("both", ("/generate", (LONG_TOKENS, 8, False)), "this app accepts at most 1024"),
    ("both", ("/generate", ("Hello there", 0, False)), "is less than minimum value"),
    ("both", ("/generate", ("Hello there", 1000, False)), "is greater than maximum value"),
    ("both", ("/generate", ("Hello there", "abc", False)), "Expected a `float`"),
    ("both", ("/generate", ("Hello there", 2.5, False)), "New tokens must be a whole number"),
    ("both", ("/generate", ("Hello there", 8, "maybe")), "Chat template must be true or false"),
    # ---- SCD tab
    ("nopair", scd(text="{window}"), "load a pair first"),
    ("both", scd(text="too short"), "SCD needs at least"),
    ("both", scd(text=""), "the text is empty"),
    ("both", scd(text=BIG), "4,000,000 characters"),
    ("both", scd(text=LONG_TOKENS), "this app accepts at most 1024"),
    ("both", scd(text="{window}", continuation_tokens="abc"), "Expected a `float`"),
    ("both", scd(text="{window}", continuation_tokens=3), "is less than minimum value"),
    ("both", scd(text="{window}", generated_tokens=100), "is greater than maximum value"),
    ("both", scd(text="{window}", bits="5"), "not in the list of choices"),
    ("both", scd(text="{window}", rank_k=999), "is greater than maximum value"),
    ("both", scd(text="{window}", rank_v=-8), "is less than minimum value"),
    ("both", scd(text="{window}", rank_k=12.5), "r_K must be a whole number"),
    ("both", scd(text="{window}", patch_layers=99), "is greater than maximum value"),
    ("both", scd(text="{window}", placement="somewhere"), "somewhere"),
    ("both", scd(text="{window}", placement="manual", manual_layers="a, b"), "integers separated by commas"),
    ("both", scd(text="{window}", placement="manual", manual_layers="99"), "between 0 and 29"),
    ("both", scd(text="{window}", placement="manual", manual_layers="0"), "no aligner for layer 0"),
    ("both", scd(text="{window}", placement="manual", manual_layers="1," * 150), "Manual patch layers has"),
    ("both", scd(text="{window}", bandwidth_gbps=0), "is less than minimum value"),
    ("both", scd(text="{window}", recompute_tail=600), "is greater than maximum value"),
    ("both", scd(text="{window}", recompute_tail=300), "a recomputed tail is 1 to"),
    ("both", scd(text="{window}", latency_ms=-1), "is less than minimum value"),
    ("both", scd(text="{window}", fan_out="maybe"), "All built-in specialists must be true or false"),
    ("both", scd(text="{window}", byte_budget=1), "below the smallest transform-coded payload"),
    ("both", scd(text="{window}", byte_budget=2304, coder="lzma"), "not in the list of choices"),
    # ---- eviction tab
    ("nopair", ev(), "load a pair first"),
    ("both", ev(context=""), "the context is empty"),
    ("both", ev(context="   \n  "), "the context is empty"),
    ("both", ev(context="A short context of a few words."), "give at least 65"),
    ("both", ev(context=BIG), "4,000,000 characters"),
    ("both", ev(question=BIG), "4,000,000 characters"),
    ("both", ev(context="y" * 9000, question="z" * 9000), "together"),
    ("both", ev(question=LONG_TOKENS), "tokens together"),
    ("both", ev(budget=None), "Budget (% kept) is empty"),
    ("both", ev(budget="abc"), "Budget (% kept) must be a number"),
    ("both", ev(budget="Infinity"), "Budget (% kept) must be between 0 and 100"),
    ("both", ev(budget=0), "strictly between 0 and 100"),
    ("both", ev(budget=100), "strictly between 0 and 100"),
    ("both", ev(budget=-5), "Budget (% kept) must be between"),
    ("both", ev(budget_unit="tokens kept", budget=2.5), "Budget (tokens kept) must be a whole number"),
    ("both", ev(budget_unit="tokens kept", budget=100000), "Budget (tokens kept) must be between 1 and 1024"),
    ("both", ev(budget_unit="tokens kept", budget=900), "keeps the whole"),
    ("both", ev(budget_unit="bytes"), "bytes"),
    ("both", ev(model="both"), "both"),
    ("both", ev(question_aware="maybe"), "Question-aware must be true or false"),
    ("both", ev(method="CUR"), "Method to inspect: 'CUR' is not among the methods compared"),
    ("both", ev(methods=["nope"]), "'nope' (type: <class 'str'>) is not in the list of choices"),
    # ---- calibrate / train tab
    ("nopair", cal(), "load a pair first"),
    ("both", cal(domains=["nope"]), "nope"),
    ("both", cal(domains=[]), "choose at least 1"),
    ("both", cal(fit_windows=1), "is less than minimum value"),
    ("both", cal(fit_windows="abc"), "Expected a `float"),  # a slider, or a fixed number in hosted mode
    ("both", cal(patch_layers=9), "is greater than maximum value"),
    ("both", cal(select_windows=0), "is less than minimum value"),
    ("hosted", cal(fit_windows=16), "is greater than maximum value 4"),  # hosted caps: the slider's maximum there
    ("hosted", cal(select_windows=2), "is greater than maximum value 1"),
    ("hosted", cal(rate_windows=4), "is greater than maximum value 0"),
    ("hosted", tr(contexts=4), "is greater than maximum value 2"),
    ("hosted", di(epochs=6), "is greater than maximum value 2"),
    ("hosted", ("/fit", (6, 6, 32, "bad-input-scorer")), "this hosted demo runs on a CPU, where fitting"),
    ("hosted", cal(domains=["jargon", "austen"]), "this hosted demo takes at most 1 Calibration domains"),
    ("both", cal(bits="3"), "3"),
    ("both", scd(text="{window}", bits=4), "not in the list of choices"),  # the API takes the documented strings
    ("both", cal(name=""), "the run name is empty"),
    ("both", cal(name=".."), "is not allowed"),
    ("both", cal(name="../../etc"), "is not allowed"),
    ("both", cal(name="a/b"), "is not allowed"),
    ("both", cal(name="/tmp/x"), "is not allowed"),
    ("both", tr(steps=0), "is less than minimum value"),
    ("both", tr(steps=5000), "is greater than maximum value"),
    ("both", tr(contexts=1), "is less than minimum value"),
    ("both", tr(per_head="x"), "Per layer and KV head must be true or false"),
    ("both", tr(name="."), "is not allowed"),
    ("both", tr(name="my policy"), "is not allowed"),
    ("nopair", tr(), "load a pair first"),
    ("nopair", di(), "load a pair first"),
    ("both", di(train_windows=0), "is less than minimum value"),
    ("both", di(val_every=-10), "is less than minimum value"),
    ("hosted", di(val_every=10), "is greater than maximum value 0"),
    ("both", di(epochs=60), "is greater than maximum value"),
    ("both", di(rank=1000), "is greater than maximum value"),
    ("both", di(budgets="x"), "must be true or false"),
    ("both", di(recall=0.9), "is greater than maximum value"),
    ("both", di(recall_target="truth"), "quote"),
    ("both", di(name="../x"), "is not allowed"),
    ("hosted", ("/load_calibration", ("/etc",)), "does not read local paths"),
    ("hosted", ("/load_calibration", ("{shipped_calib}",)), "does not read local paths"),
    ("both", ("/load_calibration", ("",)), "no calibration folder given"),
    ("local", ("/load_calibration", ("/nonexistent/calib",)), "is not a folder"),
    ("local", ("/load_calibration", ("{empty}",)), "calibration.safetensors missing"),
    ("local", ("/load_calibration", ("{calib_garbage}",)), "not a readable safetensors file"),
    ("local", ("/load_calibration", ("{calib_nokeys}",)), "not a complete SCD calibration"),
    ("local", ("/load_calibration", ("{calib_noheader}",)), "has no scdviz header"),
    ("local", ("/load_calibration", ("{calib_oldformat}",)), "scd calibration of format 1"),
    ("local", ("/load_calibration", ("{policy_folder}",)), "holds a distillcache policy, not a scd calibration"),
    ("local", ("/load_calibration", ("{calib_other_pair}",)), "was made for"),
    # ---- results tab
    ("both", ("/open_shipped", ("/etc/passwd",)), "/etc/passwd"),
    ("both", ("/open_upload", (["@notjson.json"],)), "is not a JSON file"),
    ("both", ("/open_upload", (["@dict.json"],)), "is not a scdviz benchmark record"),
    ("both", ("/open_upload", (["@empty.json"],)), "is not a scdviz benchmark record"),
    ("both", ("/open_upload", (["@norows.json"],)), "the record has no rows"),
    ("both", ("/open_upload", (["@otherkind.json"],)), "unknown bench kind 'speed'"),
    ("both", ("/open_upload", (["@garbage.csv"],)), "needs one bench_kind"),
    ("both", ("/open_upload", (["@binary.csv"],)), "not a readable CSV"),
    ("both", ("/open_upload", (["@garbage.csv", "@notjson.json"],)), "needs one bench_kind"),
    ("both", ("/open_shipped", ("{thirteen_shipped}",)), "open at most 12 records at once"),
    ("both", ("/open_upload", (["@deep.json"],)), "nests its JSON too deeply"),
    ("both", ("/open_upload", (["@rows.csv"],)), "holds more than 20,000 rows"),
    ("both", ("/open_upload", (["@wide.csv"],)), "has 400 columns"),
    ("both", ("/res_figures", ()), "no figures to download yet"),
    ("both", ("/scd_figures", ()), "no figures to download yet"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Folders and uploads the rows name: broken models, foreign adapters, damaged calibrations."""
    from conftest import tiny_model
    from peft import LoraConfig, get_peft_model

    from scdviz import data, settings
    from scdviz.models import builtin
    from scdviz.scd.calibration import shipped_folder

    root = tmp_path_factory.mktemp("bad")
    out = {}
    (out_empty := root / "empty").mkdir()
    out["empty"] = out_empty
    tiny = tiny_model("llama")
    lora = get_peft_model(tiny, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(root / "lora_other")
    out["lora_other"] = root / "lora_other"
    tiny_model("llama").save_pretrained(root / "tiny")
    for f in builtin.producer_dir().glob("*token*"):
        shutil.copy(f, root / "tiny" / f.name)
    out["tiny"] = root / "tiny"
    (root / "broken_model").mkdir()
    (root / "broken_model" / "config.json").write_text("{not json")
    out["broken_model"] = root / "broken_model"
    jargon, bible = shipped_folder(J), shipped_folder(B)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from scdviz import artefact
    from scdviz.scd.calibration import FILE

    shipped = artefact.load(jargon / FILE, "scd-calibration")
    with safe_open(str(jargon / FILE), "pt") as fh:
        header = json.loads(fh.metadata()["scdviz"])
    for name in ("calib_garbage", "calib_nokeys", "calib_noheader", "calib_oldformat", "policy_folder"):
        (root / name).mkdir()
        out[name] = root / name
    (root / "calib_garbage" / FILE).write_bytes(b"\x00" * 64)
    artefact.save(root / "calib_nokeys" / FILE, "scd-calibration", {"k.0.enc": shipped.tensors["k.0.enc"]},
                  shipped.identity, shipped.config, {})
    save_file({"x": shipped.tensors["k.0.enc"]}, str(root / "calib_noheader" / FILE))
    save_file({"x": shipped.tensors["k.0.enc"]}, str(root / "calib_oldformat" / FILE),
              metadata={"scdviz": json.dumps(header | {"version": 1})})
    shutil.copy(settings.ASSETS_DIR / "policy" / "global" / "best.safetensors", root / "policy_folder" / FILE)
    assert load_file(str(root / "policy_folder" / FILE))  # a real artefact, only of another kind
    out["calib_other_pair"], out["shipped_calib"] = bible, jargon
    record = {"format": "scdviz-bench/1", "kind": "scd", "settings": {}, "seed": 0, "rows": []}
    uploads = {"notjson.json": b"{this is not json", "dict.json": b'{"kl": 1}', "empty.json": b"[]",
               "norows.json": json.dumps(record).encode(),
               "otherkind.json": json.dumps(record | {"kind": "speed", "rows": [{"kl": 1}]}).encode(),
               "garbage.csv": b"a,b\n1,2\n", "binary.csv": bytes(range(256)) * 4,
               "deep.json": b"[" * 100_000 + b"]" * 100_000,
               "rows.csv": b"bench_kind,kl\n" + b"evict,0.1\n" * 20_001,
               "wide.csv": (",".join(f"c{i}" for i in range(400)) + "\n" + ",".join("1" * 400) + "\n").encode()}
    for name, content in uploads.items():
        (root / name).write_bytes(content)
        out["@" + name] = root / name
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin.producer_dir())
    window = next(iter(data.token_windows(tok, data.load_split("jargon", "eval"), 160, 1)))
    out["window"] = tok.decode(window)
    from scdviz.app import results

    out["thirteen_shipped"] = list(results.shipped_records())[:13]  # one more than the Results tab opens at once
    return out


def _resolve(args, files):
    from gradio_client import handle_file

    resolved = []
    for a in args:
        if isinstance(a, list):  # several files (the Results tab's upload)
            resolved.append(_resolve(a, files))
        elif isinstance(a, str) and a.startswith("@"):
            resolved.append(handle_file(str(files[a])))
        elif isinstance(a, str) and a.startswith("{") and a.endswith("}") and a[1:-1] in files:
            value = files[a[1:-1]]
            resolved.append(value if isinstance(value, list) else str(value))
        else:
            resolved.append(a)
    return resolved


def _clients(url):
    from gradio_client import Client

    loaded = Client(url, verbose=False)
    loaded.predict(P, J, api_name="/load_pair")
    return {"loaded": loaded, "fresh": Client(url, verbose=False)}


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("apps")
    with running_app(folder / "hosted.log", SCDVIZ_HOSTED="1", SCDVIZ_WORK=str(folder / "hosted")) as hosted, \
            running_app(folder / "local.log", SCDVIZ_WORK=str(folder / "local"), HF_HUB_OFFLINE="1") as local:
        yield {"hosted": _clients(hosted), "local": _clients(local), "logs": folder,
               "urls": {"hosted": hosted, "local": local}}


def _ask(client, endpoint, args) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        result = client.predict(*args, api_name=endpoint)
        return f"(no error: {str(result)[:200]})", time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 - the message is what we check
        return str(err), time.perf_counter() - t0


def test_the_arguments_follow_the_request_fields():
    from scdviz.app import requests

    for args, request in ((SCD, requests.ScdRequest), (EV, requests.EvictRequest), (CAL, requests.CalibrateRequest),
                          (TR, requests.TrainRequest), (DI, requests.DistilRequest)):
        assert list(args) == list(request.controls())[:len(args)], request.__name__


def test_the_catalogue_is_large_and_covers_every_tab():
    assert len(ROWS) >= 60
    endpoints = {endpoint for _, (endpoint, _), _ in ROWS}
    assert endpoints >= {"/load_pair", "/generate", "/scd_transfer", "/evict", "/calibrate", "/distil", "/train",
                         "/load_calibration", "/open_upload", "/open_shipped"}


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[f"{r[1][0]}-{i}" for i, r in enumerate(ROWS)])
def test_bad_input_gets_a_specific_message(row, apps, files):
    mode, (endpoint, args), fragment = ROWS[row]
    targets = {"both": ("hosted", "local"), "hosted": ("hosted",), "local": ("local",),
               "nopair": ("hosted", "local")}[mode]
    for target in targets:
        client = apps[target]["fresh" if mode == "nopair" else "loaded"]
        message, seconds = _ask(client, endpoint, _resolve(args, files))
        assert fragment in message, f"{target} app: expected {fragment!r}, got {message[:400]!r}"
        assert "internal error" not in message.lower() and "Traceback" not in message
        assert seconds < 10, f"{target} app took {seconds:.1f} s to refuse"


def test_no_handler_failed_unexpectedly(apps):
    """The server logs hold no 'handler ... failed' trace from any row above (run last in this module)."""
    for log in Path(apps["logs"]).glob("*.log"):
        assert "failed" not in "".join(line for line in log.read_text().splitlines(True) if "scdviz.ui" in line), log


def test_an_unknown_endpoint_is_a_404_that_says_so(apps):
    import urllib.error
    import urllib.request

    for url in apps["urls"].values():
        for path, body in (("gradio_api/queue/join", {"data": [], "fn_index": 9999, "session_hash": "x"}),
                           ("gradio_api/call/no_such_endpoint", {"data": []})):
            req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            assert err.value.code == 404 and b"no such endpoint" in err.value.read()


def test_a_lone_surrogate_is_refused_over_http(apps):
    """JSON can carry an unpaired surrogate ("\\udc80"), which no tokenizer takes: refused by name."""
    import urllib.request

    for url in apps["urls"].values():
        body = b'{"data": ["builtin:smollm2-135m", "builtin:jar\\udc80gon"]}'
        req = urllib.request.Request(url + "gradio_api/call/load_pair", body, {"content-type": "application/json"})
        event = json.loads(urllib.request.urlopen(req, timeout=10).read())["event_id"]
        with urllib.request.urlopen(f"{url}gradio_api/call/load_pair/{event}", timeout=60) as fh:
            stream = fh.read().decode()
        assert "consumer: the model source holds a character that is not valid Unicode text" in stream, stream[:400]
        assert "internal error" not in stream


def test_the_docs_scripting_example_runs(apps):
    """docs/hosting.md's gradio_client example, run as written against a local app."""
    import contextlib
    import io

    text = (Path(__file__).resolve().parents[1] / "docs" / "hosting.md").read_text()
    code = text.split("## Scripting the app")[1].split("```python")[1].split("```")[0]
    url = 'URL = "http://127.0.0.1:7860/"'
    assert url in code
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(code.replace(url, f"URL = {apps['urls']['local']!r}"), namespace)  # noqa: S102 - our own docs
    assert namespace["summary"].startswith("SnapKV: keeps")
    assert {row[0] for row in namespace["table"]["data"]} == {"ObservedAttention", "SnapKV", "StreamingLLM"}
    assert "SnapKV" in printed.getvalue()
