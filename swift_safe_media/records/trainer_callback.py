"""The run summary from inside a transformers ``Trainer`` (ms-swift adds it by itself).

Every logging step (``logging_steps``) and at the end of training, the main process
logs the summary line and writes ``safe_media_summary.json`` next to the quarantine
registry (else into the stats folder). Every rank records the step it reached, so the
summary shows whether the ranks stayed in step.
"""

from __future__ import annotations

from transformers import TrainerCallback

from . import summary


class SummaryCallback(TrainerCallback):
    def __init__(self):
        self.reported_step = None

    def on_log(self, args, state, control, **kwargs):
        summary.note_step(state.global_step)
        # on_train_end reports the last step, once the last counts are written.
        if state.global_step != self.reported_step and state.global_step < state.max_steps:
            self._report(state)

    def on_train_end(self, args, state, control, **kwargs):
        summary.note_step(state.global_step)
        self._report(state, final=True)

    def _report(self, state, final: bool = False) -> None:
        self.reported_step = state.global_step
        if state.is_world_process_zero:
            summary.report(step=state.global_step, final=final)
