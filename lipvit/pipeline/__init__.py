"""The machinery of ``lipvit pipeline``: the settings and the step graph
(:mod:`lipvit.pipeline.steps`) and running the steps
(:mod:`lipvit.pipeline.scheduler`). Which steps a run takes (``build_plan``:
the commands and their options) and the command itself are in
:mod:`lipvit.commands.pipeline`; nothing here imports ``lipvit.commands``.
"""
