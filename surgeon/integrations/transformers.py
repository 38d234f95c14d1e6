"""``ReinitCallback``: conditioned re-initialization as the first thing a transformers ``Trainer`` does.

    from surgeon.integrations.transformers import ReinitCallback
    Trainer(model, args, train_dataset=..., callbacks=[ReinitCallback(layers="-2-", seed=0)]).train()

At ``on_train_begin`` the optimizer exists but holds no state yet (its moments are created at the
first step), and it refers to the very parameters ``reinit_`` changes in place, so nothing needs
rebuilding. A run resumed from a checkpoint (``state.global_step > 0``) is left alone: its weights
are the trained ones. Under DDP/FSDP every process re-initializes its own part (no communication
beyond the report's spectra); the report is logged by the main process.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ..options import ReinitOptions
    from ..report.report import Report

logger = logging.getLogger("surgeon")


def _reinit_keywords() -> frozenset[str]:
    """The keywords ``surgeon.reinit_`` takes besides the module: its own and the fields of ReinitOptions."""
    from ..in_memory import reinit_
    from ..options import ReinitOptions

    own = [p.name for p in inspect.signature(reinit_).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return frozenset(own) | {f.name for f in fields(ReinitOptions)}


class ReinitCallback(TrainerCallback):
    """Runs ``surgeon.reinit_(model, options=options, **keywords)`` at ``on_train_begin``.

    Args:
        options: What to re-initialize and how (a :class:`surgeon.ReinitOptions`; default: the defaults).
        **keywords: Anything :func:`surgeon.reinit_` takes: fields of ReinitOptions (``layers``, ``seed``,
            ...) and its own (``num_heads``, ``example_inputs``, ``full``, ...).

    Raises:
        OptionError: A keyword is not one :func:`surgeon.reinit_` takes.

    The report is kept as ``.report`` (None until training begins). The reset's record goes on the model's
    config (``config.json`` when saved); at the end of training, the card (base model, tags, the reset, the
    command that makes the reset point again) is written into the output folder.
    """

    def __init__(self, options: ReinitOptions | None = None, **keywords: Any) -> None:
        self._model: nn.Module | None = None
        unknown = sorted(set(keywords) - _reinit_keywords())
        if unknown:
            from ..errors import OptionError

            raise OptionError(
                f"ReinitCallback: unknown option(s) {', '.join(unknown)}; it takes the keyword options of surgeon.reinit_"
            )
        self.options = {"options": options, **keywords}
        self.report: Report | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        if state.global_step > 0:
            logger.info("surgeon: resumed at step %d, weights left as loaded (no re-initialization)", state.global_step)
            return
        if optimizer is not None and any(optimizer.state.values()):
            from ..errors import OptionError

            raise OptionError(
                "ReinitCallback: the optimizer already holds state for these weights; re-initialize before the first step"
            )
        if model is None:  # the Trainer passes its model; a caller that does not gets a reason, not a TypeError
            from ..errors import OptionError

            raise OptionError("ReinitCallback: on_train_begin was called without the model to re-initialize")
        from ..in_memory import reinit_

        self.report = reinit_(model, **self.options)
        self._model = model
        if state.is_world_process_zero:
            print(self.report)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Say in the model's record how it was trained, and write its card (base_model, tags, the reset) into
        the output folder, where ``trainer.save_model()`` then saves the model beside it (a README.md there
        already is left as it is)."""
        from pathlib import Path

        from ..in_memory import lineage_card, mark_trained

        model = kwargs.get("model") or getattr(self, "_model", None)
        if self.report is None or model is None:  # resumed, or never reset: nothing of surgeon's to write
            return
        mark_trained(model, f"trained {state.global_step} steps with the transformers Trainer")
        card = lineage_card(model)
        readme = Path(args.output_dir or ".") / "README.md"
        if card is not None and state.is_world_process_zero and not readme.exists():
            readme.parent.mkdir(parents=True, exist_ok=True)
            readme.write_text(card, encoding="utf-8")
