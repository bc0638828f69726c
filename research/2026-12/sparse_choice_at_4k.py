"""Why the default conversion finds 0-2 of 8 passkeys at 4,000 tokens: the training, or the choice of pairs? (issue 47)

One converted run folder (``hf-knorm convert``'s output; the default ``x/1 + softmax window 64 + sinks 4 + sparse 256
(value_over_key)``, whose distant part solved to mix 0) is read back with its weights unchanged and answers the
passkey (or, ``--task niah``, needle) cells (``hf_knorm.evaluation.retrieval``: 4 depths x 2 seeds per length, 10
greedy tokens, exact match) with:

- ``all``: every pair kept, i.e. the model unpatched (plain softmax): with mix 0 and ``K >=`` every older key, the
  sparse cache computes exactly this, so it says what the trained weights can do at 4,000 tokens;
- ``value_over_key K``: the released score with ``K`` pairs (``set_sparse_cache``: ``sparse K``, the mix kept);
- ``prefix_kv_diff K`` (or any other score of ``hf_knorm.normalizations.sparse_choice.SPARSE_SCORES``): the score
  as the library computes it, set by ``set_sparse_cache``;
- ``prefix_kv_diff:K:C``: the same with ``C`` clusters beside the cache (:mod:`hf_knorm.attention.distant_clusters`),
  their codebooks fitted as a conversion fits them (:func:`hf_knorm.conversion.clusters.add_clusters`), untrained.

The prototype of ``prefix_kv_diff`` (the same score computed once per context outside the library, its pairs' scores
looked up by position: commit e0c61d0 of this script) found 8, 7, 6 of 8 passkeys at 1k/2k/4k on seed 0; the built
score is measured with the same cells.

Usage: ``OMP_NUM_THREADS=2 python research/2026-12/sparse_choice_at_4k.py --run runs/sparse_s0 \\
           --cells all,value_over_key:256,value_over_key:768,prefix_kv_diff:256,prefix_kv_diff:768 --lengths 4000``
(~2-3 min a cell at 4,000 tokens on 2 threads). Written up in docs/results/conversion.md, "Why 4,000 tokens fail".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import transformers

import hf_knorm
from hf_knorm.conversion.beyond_window import beyond_window_blocks, beyond_window_perplexities
from hf_knorm.conversion.clusters import add_clusters
from hf_knorm.evaluation.retrieval import hits_by_length, retrieval_records
from hf_knorm.models.sparse_cache_size import set_sparse_cache

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="an hf-knorm convert output folder")
    parser.add_argument("--cells", default="all,value_over_key:256,value_over_key:768,prefix_kv_diff:256")
    parser.add_argument("--lengths", default="4000")
    parser.add_argument("--task", default="passkey", choices=("passkey", "niah"))
    parser.add_argument("--beyond", action="store_true",
                        help="also each cell's perplexity beyond the window (convert's 1,024-token blocks, positions "
                             ">= 256), worst domain as a multiple of the original's figures in the run's convert.json")
    parser.add_argument("--out", default=None, help="a JSON file for the records (default: print only)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.run)
    record = json.loads((Path(args.run) / "convert.json").read_text())
    blocks = None
    if args.beyond:
        settings = record["settings"]
        blocks = beyond_window_blocks(settings["eval_domains"], tokenizer, settings["eval_tokens"])
    results = {}
    for cell in args.cells.split(","):
        model = hf_knorm.from_pretrained(args.run).eval()
        if cell == "all":
            hf_knorm.unpatch(model)
            label = "every pair kept (unpatched)"
        else:
            score, sparse, *clusters = cell.split(":")
            set_sparse_cache(model, int(sparse), score)  # an unknown score fails here
            if clusters:
                add_clusters(model, tokenizer, int(clusters[0]))
            label = hf_knorm.patched_normalization(model)
        started = time.perf_counter()
        records = retrieval_records(model, tokenizer, (args.task,), lengths, desc=cell)
        results[cell] = {"label": label, "hits": hits_by_length(records)[args.task],
                         "answers": [answer["answer"] for answer in records],
                         "retrieval_seconds": time.perf_counter() - started}
        beyond = ""
        if blocks is not None:
            perplexities = beyond_window_perplexities(model, blocks, cell)
            ratios = {name: value / record["beyond_window"]["domains"][name]["original_perplexity"]
                      for name, value in perplexities.items()}
            worst = max(ratios, key=ratios.get)
            results[cell]["beyond_window"] = {"perplexity": perplexities, "ratio_to_original": ratios}
            beyond = f" {ratios[worst]:.3f}x ({worst}) |"
        print(f"| {label} | " + " | ".join(f"{hit}/{total}" for hit, total in results[cell]["hits"].values()) + " |"
              + beyond, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
