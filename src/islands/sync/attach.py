"""Zero-touch strategies: run a strategy's hooks from the optimizer's step hooks, around an unchanged loop.

    with islands.outer.DiLoCo(inner_steps=50).attach(model, opt, world) as model:
        for x, y in batches:                 # the user's loop, untouched
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()
    global_model = strategy.eval_model(model)

torch calls an optimizer's pre-step hooks after backward has filled the gradients and its post-step
hooks after the update: exactly where the loop would call `after_backward` and `after_step`
(torchft's DiLoCo and accelerate's LocalSGD hook in the same places). Steps are counted from the
first `opt.step()` inside the block (or from `start`). Leaving the block runs `finish` (the final
synchronisation) unless the block raised, and removes the hooks either way.
"""

from __future__ import annotations


class Attached:
    def __init__(self, strategy, model, optimizer, world, start: int = 0):
        self.strategy, self.optimizer, self.world = strategy, optimizer, world
        self.model = model
        self.step = int(start)
        self._handles: list = []

    def __enter__(self):
        self.model = self.strategy.wrap(self.model, self.optimizer, self.world)
        self.step = max(self.step, self.world.start_step)  # an elastic joiner starts where it entered
        self._handles = [
            self.optimizer.register_step_pre_hook(self._before_step),
            self.optimizer.register_step_post_hook(self._after_step),
        ]
        return self.model

    def _before_step(self, optimizer, args, kwargs):
        self.strategy.after_backward(self.model, self.step)

    def _after_step(self, optimizer, args, kwargs):
        step, self.step = self.step, self.step + 1
        self.strategy.after_step(self.model, optimizer, step)

    def __exit__(self, kind, value, tb):
        for h in self._handles:
            h.remove()
        self._handles = []
        if kind is None:
            self.strategy.finish(self.model)
        return False
