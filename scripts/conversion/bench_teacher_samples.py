"""Benchmark: drawing the conversion's teacher samples, the nucleus filter against Transformers' sort.

`hf-knorm convert`'s first run draws 65,536 tokens of the original model's own samples before it converts anything
(:mod:`hf_knorm.conversion.teacher_text`). This draws the first batch of that draw (the same 32 prompts, the same
seed, up to 256 new tokens each) on the default model, alternately with :class:`hf_knorm.conversion.nucleus.
NucleusFilter` and with ``TopPLogitsWarper`` (which sorts the 49,152-token vocabulary at every step), ``--repeats``
times each, and reports the median time of each, their ratio, and whether the two drew the same tokens. With
``--cached FILE`` (a draw cached by a conversion, ``~/.cache/hf_knorm/teacher_text/*.jsonl``) it also checks the
first batch's texts against that file's first 32.

Usage:
    python scripts/conversion/bench_teacher_samples.py --repeats 3 --cached ~/.cache/hf_knorm/teacher_text/KEY.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_knorm import load_default_model
from hf_knorm.conversion import teacher_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cached", type=Path, help="a cached draw to compare the first batch's texts with")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_default_model()
    model.eval()
    tokenizer.padding_side = "left"
    prompts = teacher_text.prompt_texts(tokenizer, 0, teacher_text.BATCH_SIZE)
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    times, outputs = {"filter": [], "sort": []}, {}
    for _ in range(args.repeats):
        for name in times:  # alternated: a slower stretch of a shared machine falls on both
            torch.manual_seed(0)  # the draw's seed, as teacher_text sets it before its first batch
            started = time.perf_counter()
            with torch.no_grad():
                outputs[name] = teacher_text.generate_batch(model, batch, pad, sort_vocabulary=name == "sort")
            times[name].append(time.perf_counter() - started)
    new = outputs["filter"][:, batch["input_ids"].shape[1]:]
    result = {"threads": args.threads, "repeats": args.repeats, "batch": list(new.shape),
              "seconds": {name: statistics.median(values) for name, values in times.items()},
              "all_seconds": times, "same_tokens": torch.equal(outputs["filter"], outputs["sort"])}
    result["speedup"] = result["seconds"]["sort"] / result["seconds"]["filter"]
    if args.cached:
        cached = [json.loads(line)["text"] for line in args.cached.read_text().splitlines()[:len(prompts)]]
        drawn = [teacher_text.sample_text(tokenizer, prompt, row)[0] for prompt, row in zip(prompts, new.tolist())]
        result["same_as_cached"] = sum(a == b for a, b in zip(drawn, cached))
        result["cached_compared"] = len(cached)
    print(json.dumps({k: v for k, v in result.items() if k != "all_seconds"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
