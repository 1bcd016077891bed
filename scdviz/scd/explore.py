"""One prompt, every SCD method: the app's view, computed by the benchmark's own code.

``user_plan`` turns the app's plan controls into a Plan; ``explore`` runs
``scdviz.scd.bench.bench`` on the single window made from the user's text (its last
``cont_len`` tokens are the teacher-forced continuation), so the numbers equal
``python -m scdviz bench scd`` on the same window and settings. No figures, no gradio.
"""

from __future__ import annotations

from scdviz.models.pair import Pair
from scdviz.scd import bench
from scdviz.scd import calibrate as cal
from scdviz.scd import plan as plans


def user_plan(
    calib: cal.Calibration,
    patch_k: int | None = None,
    placement: str = "selected",
    bits: int | None = None,
    rank_k: int | None = None,
    rank_v: int | None = None,
    layers: list[int] | None = None,
) -> plans.Plan:
    """The SCD full plan from the app's controls.

    placement: "selected" (the calibration's order), "drift", or "manual" (``layers``).
    rank_k / rank_v: one rank for every layer (default: the operating point's ranks).
    """
    d_k = [c.max_rank for c in calib.key_codes]
    d_v = [c.max_rank for c in calib.value_codes]
    for name, r, full in (("key", rank_k, max(d_k)), ("value", rank_v, max(d_v))):
        if r is not None and not 1 <= r <= full:
            raise ValueError(f"{name} rank {r} is out of range: this calibration stores ranks 1..{full}")
    if placement == "manual":
        layers = sorted(set(layers or []))
        for layer in layers:
            calib.patch_for(layer)  # ValueError naming the layers that have aligners
        base = cal.operating_plan(calib, patch_k=0, bits=bits)
        patch_layers = layers
    else:
        base = cal.operating_plan(calib, patch_k=patch_k, placement=placement, bits=bits)
        patch_layers = base.layers_in("patch")
    rk = [min(rank_k, d) for d in d_k] if rank_k else base.rank_k
    rv = [min(rank_v, d) for d in d_v] if rank_v else base.rank_v
    return plans.scd_plan(rk, rv, patch_layers, code_bits=base.code_bits, code_group=base.code_group, name="SCD full")


def window_of(pair: Pair, text: str, cont_len: int, max_tokens: int) -> list[int]:
    """Token ids of ``text`` as one benchmark window (prompt + continuation)."""
    if not text or not text.strip():
        raise ValueError("the prompt is empty")
    ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < cont_len + 16:
        raise ValueError(f"the text has {len(ids)} tokens; SCD needs at least {cont_len + 16} "
                         f"(a prompt of 16+ tokens and {cont_len} continuation tokens to score)")
    if len(ids) > max_tokens:
        raise ValueError(f"the text has {len(ids)} tokens; this app accepts at most {max_tokens}")
    return list(ids)


def explore(pair: Pair, calib: cal.Calibration, text: str, plan: plans.Plan, cont_len: int = 32,
            gen_tokens: int = 24, sweeps: bool = False, max_tokens: int = 1024) -> bench.BenchReport:
    """Every method (oracle, raw, 4-bit, DroidSpeak, SCD reuse-only, ``plan``) on the user's text."""
    window = window_of(pair, text, cont_len, max_tokens)
    return bench.bench(pair, calib, [window], cont_len, gen_tokens, sweeps, (), pair.consumer_source,
                       progress=False, scd_full=plan)
