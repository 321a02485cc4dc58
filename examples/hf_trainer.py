"""An ordinary Hugging Face Trainer script, trained as islands by adding one callback (docs/frameworks.md).

    islands run --workers 4 --islands 2 --separate-jobs examples/hf_trainer.py     # 2 islands x 2 workers
    torchrun --nproc-per-node 2 examples/hf_trainer.py                              # one island: DDP alone

On several machines each island is its own torchrun with ISLANDS_CROSS_* set (docs/frameworks.md). GPT-2 from a
small config (random initialisation, nothing downloaded) on the bytes of Python's `json` package as tokens. Inside
an island the Trainer runs DDP over its own workers; across islands DiLoCo exchanges every INNER_STEPS steps.
The lines marked `# islands` are the whole change to the script.
"""

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import islands  # islands
from islands.integrations.transformers import IslandsCallback  # islands

CONTEXT = 32
STEPS, INNER_STEPS = int(os.environ.get("STEPS", "40")), int(os.environ.get("INNER_STEPS", "10"))
OUT = os.environ.get("OUT_DIR", "runs/hf_trainer")
SAVE_STEPS = int(os.environ.get("SAVE_STEPS", "0"))  # a checkpoint every SAVE_STEPS steps (0: none)
RESUME = os.environ.get("RESUME") == "1"  # continue from the latest checkpoint in OUT_DIR


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self):
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i):
        w = self.data[i * CONTEXT : (i + 1) * CONTEXT].long()
        return {"input_ids": w, "labels": w}  # GPT-2 shifts the labels itself


def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def main():
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=OUT,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="steps" if SAVE_STEPS else "no",
        save_steps=SAVE_STEPS or 500,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = IslandsCallback(islands.outer.DiLoCo(inner_steps=INNER_STEPS))  # islands
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(corpus()), callbacks=[callback])  # islands
    result = trainer.train(resume_from_checkpoint=True if RESUME else None)
    trainer.save_model()  # the global model (the callback put it into `model` at the end)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    report(callback, model, losses, result.training_loss)


def report(callback, model, losses, training_loss):
    """One JSON line per worker (the test and the bench read them): losses, bytes across, the model's digest."""
    world = callback.run.join()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    line = {
        "island": world.island,
        "islands": world.islands,
        "local_rank": world.local_rank,
        "losses": losses,
        "training_loss": training_loss,
        "cross_bytes": callback.cross_bytes,
        "rounds": callback.run.strategy.rounds,
        "digest": digest,
    }
    # one write for the whole line: under PYTHONUNBUFFERED print writes the text and its newline in two, and the
    # other island's rank 0 shares this stdout
    sys.stdout.write("RESULT " + json.dumps(line) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
