"""Train a Hugging Face causal LM from a DeepSpeed-style loop of your own, through the loss of a GPU.

    ntp-ds launch --nproc-per-node 4 examples/train_hf.py --model MODEL_DIR --data TOKENS.bin --steps 100 \\
        --tp 2 --replicas 2 --deepspeed_config ds_config.json --out final/

The same script runs under `torchrun --nproc-per-node 4 examples/train_hf.py ...` and `deepspeed --num_gpus 4
examples/train_hf.py ...` (what each launcher does when a worker dies: docs/usage.md, "Your own training loop").
`--model` is an HF model directory (each rank reads only its slices of the weights), `--data` a token file
(`ntp_ds.batch.token_file`), `--deepspeed_config` DeepSpeed's JSON (`train_batch_size` is the global batch).
`--faults` injects failures, as `fault.faults` of `ntp-ds train`: a JSON list, e.g.
'[{"rank": 3, "step": 5, "phase": "forward", "kind": "crash"}, {"rank": 3, "step": 9, "kind": "repair"}]'.
The final weights go to `--out` as an HF directory (`AutoModelForCausalLM.from_pretrained(OUT)` loads it).
"""

import argparse
import json
import sys

import ntp_ds
from ntp_ds.batch.token_file import TokenFile


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--data", required=True, help="token file (uint16 or uint32 ids back to back)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to train")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of a healthy replica")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--faults", default="[]", help="JSON list of faults to inject (default: none)")
    p.add_argument("--seed", type=int, default=0, help="data order seed")
    p.add_argument("--out", required=True, help="where to write the final weights (HF directory)")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    faults = json.loads(args.faults)
    data = TokenFile(args.data, args.seq_len)

    def report(kind, step, fields):
        if kind in ("recovery", "join") and engine.global_rank == 0:
            print(f"{kind} after step {step}: TP degrees {fields.get('degrees_before')} -> "
                  f"{fields.get('degrees_after')}", file=sys.stderr, flush=True)

    engine = ntp_ds.initialize(model=args.model, config=args.deepspeed_config,
                               ntp={"tp": args.tp, "replicas": args.replicas, "fault_tolerance": {"faults": faults}},
                               on_event=report)
    for step in engine.train_steps(args.steps):
        with engine.attempt(step):
            losses = []
            for batch in engine.micro_batches(data, seed=args.seed):
                loss = engine(batch)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        if engine.global_steps > step and engine.global_rank == 0:
            print(f"step {step + 1}: loss {sum(losses) / len(losses):.4f} (replica 0's micro-batches)", flush=True)
    engine.save_pretrained(args.out)
    engine.close()
    return 0 if engine.stopped_by is None else 128 + engine.stopped_by


if __name__ == "__main__":
    sys.exit(main())
