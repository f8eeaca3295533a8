"""The progress bar of a command-line run: Lightning's rich bar, counting epochs as a ``max_steps`` run has them.

Lightning's :class:`RichProgressBar` titles the training bar ``Epoch {e}/{max_epochs - 1}``; a run bounded by
``max_steps`` (every config here) has ``max_epochs == -1``, so every such run read "Epoch 0/-2".
:class:`StepsProgressBar` writes ``Epoch {e}`` there and ``Epoch {e}/{last}`` when the run has a last epoch;
:func:`use_steps_progress_bar` puts it in the place of the trainer's rich bar, with that bar's options.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["StepsProgressBar", "use_steps_progress_bar"]


class StepsProgressBar(RichProgressBar):
    """:class:`RichProgressBar` whose training bar is titled ``Epoch 0`` in a run without a last epoch."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning's hook (private; tests/cli/test_cli.py notices if it stops being called)
        last = self.trainer.max_epochs
        text = f"Epoch {current_epoch}" + (f"/{last - 1}" if last is not None and last > 0 else "")
        return f"{text:{len(self.validation_description)}}"  # as long as the validation bar's (no flicker)


def use_steps_progress_bar(trainer: Any) -> None:
    """Replace the trainer's :class:`RichProgressBar` (Lightning's default, or one configured) by a
    :class:`StepsProgressBar` with its options; any other progress bar, or none, stays."""
    bar = trainer.progress_bar_callback
    if type(bar) is not RichProgressBar:
        return
    ours = StepsProgressBar(refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme,
                            console_kwargs=bar._console_kwargs)
    trainer.callbacks[trainer.callbacks.index(bar)] = ours
