"""The rank script of ``bench/bench_ranks.py``'s torchrun row: it imports nothing and exits at
once, so a launch measures torchrun's agent (its rendezvous included) and the start of
``--nproc_per_node`` Python processes, nothing of a job."""
