"""Random rewards for bench/verl_grpo.py, in verl's custom reward function signature (every update does real work)."""

import random


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return random.Random(hash(solution_str)).random()
