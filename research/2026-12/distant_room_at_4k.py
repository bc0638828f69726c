"""How much a part beside the window could earn at 4,096 tokens, where a 25% budget no longer holds the whole block.

Issue 47 asks the distant part to lower perplexity beyond the window by 10% against the window-only ablation, with
the model holding at most 25% of the original's pairs at 4k. ``convert`` measures "beyond the window" on 1,024-token
blocks (:mod:`hf_knorm.conversion.beyond_window`), where 25% of 4k is 1,024 pairs: as many as the block has, so the
budget can buy back everything there by keeping exact pairs, and the 10% cannot tell a part that summarizes the
older keys from one that stores them (clustered_distant_part.py: 512 mean pairs hold one or two keys each there).

This script measures the same quantities on 4,096-token blocks (tokens at positions >= 256 scored, as ``convert``
does), on a converted run's weights unchanged:

- ``original``: the default model, unpatched;
- ``exact``: the converted weights under plain softmax over every key (what any distant part jointly weighted by
  softmax with the window could at most reach: its ceiling);
- ``sparse K``: the converted model's window, sinks and a sparse cache of ``K`` pairs (its ``prefix_kv_diff``
  score), the distant part off (the window-only ablation; ``K`` = the run's is the default model itself, whose mix
  is 0). ``K = 1024 - W - S`` spends the whole 25% budget at 4k on exact pairs.

The ceiling's gain over the ablation, ``1 - exact / ablation``, is the most any distant part could earn at 4k.

- ``clusters C`` (``--clusters``): the run's own model (its ``K`` and score) with ``C`` clusters beside its sparse
  cache (:mod:`hf_knorm.attention.distant_clusters`), the codebooks fitted as a conversion fits them
  (:func:`hf_knorm.conversion.clusters.add_clusters`), untrained.

Usage: ``OMP_NUM_THREADS=2 python research/2026-12/distant_room_at_4k.py --run runs/first3_default_s0
           --sparse 0,256,956 --out runs/kprobe/room4k_s0.json``
(``--original runs/kprobe/room4k_s0.json`` for the other runs: the same blocks; ``--sparse "" --clusters 256
--no-exact`` for the clusters alone; ``--as-saved`` for a run that trained with its clusters: its own codebooks)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers

import hf_knorm
from hf_knorm.conversion.beyond_window import START, beyond_window_blocks
from hf_knorm.conversion.clusters import add_clusters
from hf_knorm.data.heldout import held_out_perplexity
from hf_knorm.models.cluster_codebook import set_clusters
from hf_knorm.models.sparse_cache_size import set_sparse_cache
from hf_knorm.models.window_mix import distant_part_off

BLOCK = 4096


def perplexities(model, blocks: dict, label: str) -> dict[str, float]:
    return {name: held_out_perplexity(model, data, desc=f"{label}, {name}") for name, data in blocks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--sparse", default="0,256,956", help="sparse cache sizes of the window-only ablation")
    parser.add_argument("--blocks", type=int, default=4, help="4,096-token blocks per domain")
    parser.add_argument("--score", default="prefix_kv_diff", help="the sparse cache's score (the default's)")
    parser.add_argument("--original", default=None, help="a JSON this script wrote: reuse its original model's figures")
    parser.add_argument("--clusters", default="", help="numbers of clusters beside the run's own cache, e.g. 256")
    parser.add_argument("--no-exact", action="store_true", help="skip the ceiling (unpatched converted weights)")
    parser.add_argument("--as-saved", action="store_true",
                        help="the run's model as saved too, first (its own clusters and codebooks, if any)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = Path(args.run)
    record = json.loads((run / "convert.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(run)
    blocks = beyond_window_blocks(record["settings"]["eval_domains"], tokenizer, args.blocks * BLOCK, BLOCK)
    results: dict = {"block": BLOCK, "start": START, "blocks_per_domain": args.blocks}
    out = Path(args.out)

    def keep(name: str, values: dict) -> None:
        results[name] = values
        print(name, " | ".join(f"{domain} {value:.3f}" for domain, value in values.items()), flush=True)
        out.write_text(json.dumps(results, indent=1))

    if args.original:  # the same blocks for every run: the original's figures do not depend on the run
        keep("original", json.loads(Path(args.original).read_text())["original"])
    else:
        keep("original", perplexities(hf_knorm.load_default_model()[0], blocks, "original"))
    model = hf_knorm.from_pretrained(run).eval()
    results["normalization"] = hf_knorm.patched_normalization(model)  # as trained; the score below is --score
    if args.as_saved:
        keep("as saved", perplexities(model, blocks, results["normalization"]))
    for sparse in (int(value) for value in args.sparse.split(",") if value):
        set_sparse_cache(model, sparse, args.score)
        with distant_part_off(model):
            keep(f"sparse {sparse}", perplexities(model, blocks, hf_knorm.patched_normalization(model)))
    own = hf_knorm.parse_normalization(results["normalization"])
    for clusters in (int(value) for value in args.clusters.split(",") if value):
        set_sparse_cache(model, own.sparse, args.score)
        add_clusters(model, tokenizer, clusters)
        keep(f"clusters {clusters}", perplexities(model, blocks, hf_knorm.patched_normalization(model)))
        set_clusters(model, 0)
    if not args.no_exact:
        hf_knorm.unpatch(model)
        keep("exact", perplexities(model, blocks, "converted weights, softmax over every key"))


if __name__ == "__main__":
    main()
