"""Gradio tabs: widgets and wiring only. Tabs receive processing functions from scdviz.app.webapp,
build their controls from the request dataclasses (scdviz.app.requests, via controls.py) and
never import torch; figures come from scdviz.plots."""
