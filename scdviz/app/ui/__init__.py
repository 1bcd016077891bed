"""Gradio tabs: widgets and wiring only. Tabs receive processing functions from app.py and
never import torch; figures come from scdviz.plots."""
