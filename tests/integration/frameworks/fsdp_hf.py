"""A Hugging Face Trainer with FSDP2 inside its island (`fsdp="full_shard"`, `fsdp_config={"fsdp_version": 2}`), as
one island of `islands run --separate-jobs`, DiLoCo every INNER_STEPS optimizer steps through IslandsCallback
(test_frameworks.test_hf_trainer_with_fsdp_inside_each_island). SAVE_STEPS: checkpoint every so many steps;
RESUME: resume from the last checkpoint.

The stand-in for a GPU. accelerate 1.16 turns an FSDP plugin into DistributedType.FSDP only when its process state
is an accelerator kind (MULTI_GPU, MULTI_XPU, ...: AcceleratorState.__init__); a CPU job over gloo is MULTI_CPU, and
there the plugin is dropped and `prepare` wraps the model in DDP (docs/frameworks.md, "FSDP inside an island").
Everything accelerate does on the FSDP branch (FSDP2's fully_shard, its state dicts) runs on CPU gloo; only that
choice is made for accelerators. So this script, and nothing outside it, makes the choice a GPU job's state would:
after AcceleratorState's own __init__, a MULTI_CPU state given an FSDP plugin becomes FSDP with that plugin, as the
accelerator branch of __init__ sets it. What accelerate chose by itself goes into the RESULT line, so that the test
notices when a later accelerate no longer needs the stand-in.

It prints one RESULT line per worker: what accelerate chose, the distributed type the Trainer ran under, the types of
the parameters after training, this worker's shard size and the model's, the bytes of DiLoCo's exchanges and its
rounds, the losses, and a digest of the full model gathered from the shards after the final synchronisation (the
model trainer.save_model writes into OUT_DIR/island<i>)."""

import hashlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from script_results import print_result
from sums import Sums
from transformers import Trainer, TrainingArguments

import islands
from islands.integrations.transformers import IslandsCallback

STEPS, INNER_STEPS = int(os.environ["STEPS"]), int(os.environ["INNER_STEPS"])
SAVE_STEPS, RESUME = int(os.environ.get("SAVE_STEPS", "0")), bool(os.environ.get("RESUME"))
chose: list[str] = []  # the distributed type accelerate picked itself, before the stand-in


def accelerator_state(init):
    """AcceleratorState.__init__ as on a GPU: a MULTI_CPU state given an FSDP plugin becomes FSDP (module docstring)."""

    def forced(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        chose.append(str(self.distributed_type))
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    return forced


AcceleratorState.__init__ = accelerator_state(AcceleratorState.__init__)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.losses: list[float] = []

    def forward(self, x, labels=None):
        out = self.body(x)
        loss = F.mse_loss(out, labels)
        self.losses.append(loss.item())
        return {"loss": loss, "logits": out}


def full_digest(model: nn.Module) -> str:
    """A fingerprint of the full model, every parameter gathered from its shards, by name (as a saved file has
    them: the test computes the same from model.safetensors)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective over the island: every rank
        h.update(name.encode() + full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


torch.manual_seed(0)
model = Net()
numel = sum(p.numel() for p in model.parameters())
strategy = islands.outer.DiLoCo(inner_steps=INNER_STEPS)
callback = IslandsCallback(strategy)
args = TrainingArguments(
    output_dir=os.environ["OUT_DIR"],
    max_steps=STEPS,
    per_device_train_batch_size=16,
    learning_rate=0.01,
    lr_scheduler_type="constant",
    use_cpu=True,
    fsdp="full_shard",
    fsdp_config={"fsdp_version": 2},
    save_strategy="steps" if SAVE_STEPS else "no",
    save_steps=SAVE_STEPS or 500,
    report_to=[],
    disable_tqdm=True,
    logging_strategy="no",
    dataloader_num_workers=0,
)
trainer = Trainer(model=model, args=args, train_dataset=Sums(1000), callbacks=[callback])
trainer.train(resume_from_checkpoint=RESUME)  # the last checkpoint-<step> in OUT_DIR/island<i>
world = callback.run.join()
shard = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
print_result(
    {
        "island": world.island,
        "local_rank": world.local_rank,
        "accelerate_chose": chose[0],
        "distributed_type": str(trainer.accelerator.state.distributed_type),
        "param_types": sorted({type(p).__name__ for p in trainer.model.parameters()}),
        "shard_numel": shard,
        "numel": numel,
        "outer_bytes": world.ledger.sent.get("outer_delta", 0),
        "rounds": strategy.rounds,
        "losses": model.losses,
        "digest": full_digest(model),
    }
)
trainer.save_model()  # FSDP's full state dict, gathered over the island: the global model
