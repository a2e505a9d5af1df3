"""Measurements of a comparison: attention error, teacher-forced fidelity, text diffs, attention maps.

Definitions are DESIGN.md §4. Two parts:

* ``MetricsProbe`` — an engine ``Probe`` for the costly measurements (``--probes``): a shadow full
  cache per run (shared exact prompt K/V + the run's own generated K/V) gives the exact attention
  for the run's own query at every layer and decode step; teacher-forced logits (the engine feeds
  forked copies of the compressors the exact run's tokens) give KL, top-1 agreement and perplexity;
  attention maps of one layer and head for the last few decode queries.
* ``add_text_metrics`` — cheap, always on: token-level diff of each run's free-running text against
  the exact run, first differing token, similarity.

JSON layout (``CompareResult.to_json()``; every run in ``runs[]`` carries these; a value is
``null`` where it cannot be measured, e.g. no ``exact`` run among the runs or probes off)::

    run.metrics = {
      "attn_rel_error":  [[float]*L]*S,   # S = decode steps of this run (forward passes after the
                                          # first token), L = layers; ||z - a|| / ||a|| averaged
                                          # over query heads; a = exact attention over every token
                                          # this run has seen (prompt + its own tokens), z = the
                                          # method's output for the same query. Probes only.
      "attn_rel_error_mean": float,       # mean over steps and layers. Probes only.
      "kl":              [float]*S_e,     # S_e = exact run's decode steps; KL(exact || method) of
                                          # the next-token distributions, teacher-forced along the
                                          # exact run's tokens. Probes only.
      "kl_mean":         float,
      "top1_agreement":  float,           # fraction of those steps whose argmax tokens agree
      "perplexity":      float,           # exp(mean NLL) of the exact continuation (all its tokens,
                                          # the first one from the shared prefill logits)
      "first_divergence": int | null,     # index of the first generated token differing from the
                                          # exact run's (null: identical, or no exact run)
      "text_similarity": float,           # difflib ratio of the two token lists, 0..1
      "diff": [[tag, i1, i2, j1, j2]],    # difflib opcodes, exact tokens [i1:i2] vs run [j1:j2],
                                          # tag in equal | replace | delete | insert
      "task_score":      float | null,    # set by kvlab.tasks when the prompt has an answer
    }
    run.extras = {                        # probes only; for heatmaps and the kept-token strip
      "attn_map": {
        "layer": int, "head": int,        # the chosen layer and query head (default L//2, 0)
        "steps": [int]*Q,                 # decode steps of the last Q (default 8) queries
        "exact": [[float]*n]*Q,           # exact weights of those queries over the n prompt
                                          # positions (the run's own query, full cache)
        "method": [[float]*n]*Q | null,   # the method's weights at the prompt positions it keeps
                                          # (0 where dropped); null for methods that keep no
                                          # token-level positions (e.g. sketches)
      },
      "kept_positions": [int] | null,     # prompt positions kept at the end, chosen layer and the
                                          # chosen head's KV head
      "kept_density":  [float]*n | null,  # per prompt position, fraction of (layer, KV head)
                                          # pairs keeping it at the end (exact: all 1)
    }

Floats are rounded (4 significant digits) to keep the JSON small: a 2k-token prompt with 5 runs
and 8 map queries is well under 1 MB. Costs (prefill/compress/decode seconds, bytes per step)
are already in ``run.timings`` and ``run.kv_bytes_per_step``.
"""
