"""The strategy's evaluation hooks: validation, test and predict steps through the step engine's forward-only
schedule, with the user's hook on the last stage and its logs replayed on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from ..engine import StepEngine
from ..engine.logs import broadcast_object_from_last_stage, to_host
from ..parallel import ParallelState
from .last_stage import EvalLastStage, Metrics, batch_output, finish_step
from .loaders import order_predictions


class EvaluationHooks(ParallelStrategy):
    """Mixed into ``MegatronStrategy``: runs ``engine`` forward-only, logging through ``metrics``."""

    engine: Optional[StepEngine]
    metrics: Optional[Metrics]

    if TYPE_CHECKING:   # what the strategy provides
        def _state(self) -> ParallelState: ...

    def _eval_step(self, hook: str, context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert self.engine is not None and self.metrics is not None
        last_stage = EvalLastStage(module, self.metrics.capture(module, passthrough=True), hook, args[1:], kwargs)
        result = self.engine.run(args[0], last_stage, forward_only=True, step_context=context,
                                 extras=last_stage.extras)
        finish_step(module, result, self.metrics, self.root_device)
        return batch_output(result.outputs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._eval_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)
        return broadcast_object_from_last_stage(to_host(out), self._state())   # rank 0 holds the first stage

    @override
    def on_predict_end(self) -> None:
        """Predictions of every data-parallel rank, put back in dataset order on every rank."""
        assert self.lightning_module is not None
        order_predictions(self.lightning_module.trainer, self._state())
