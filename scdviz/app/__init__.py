"""The web app (Gradio): built on the library, never imported by it.

    webapp     handlers, GPU durations, build_demo, launch
    requests   one request dataclass per tab: each control declared once (label, widget, limits, default)
    inputs     the checks every field a request sends passes (messages name the field and range)
    hosting    hosted mode's rules: model sources, hub allow-list, user-named paths
    session    one visitor's calibrations, policies and folder (lives in gr.State)
    pairs      the shared LRU of loaded pairs, prompts, generation (Pair tab)
    scd, evict, train, results   each tab's work
    ui/        the tabs' widgets and wiring (gradio, never torch)
"""
