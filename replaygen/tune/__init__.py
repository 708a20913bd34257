"""The autotuner: search each kernel's launch configs per GPU, keep every trial, bake the winners.

space      which configs of one kernel kind are worth timing, and which are pruned before compiling
records    tuning records: keys, environment fingerprints, the record files under tune/<gpu>/
objective  one candidate: checked against the reference, then timed (cold state, flush cycles, CUDA graphs)
study      the search driver: Optuna (journal file or any storage URL) or exhaustive enumeration
apply      records -> per-batch-bucket dispatch tables for `replaygen build`
report     progress lines and the summary table
"""
