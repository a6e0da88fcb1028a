"""A toy scorer for the tiny random model of docs/debugging.md: 1 for a response of at most 3
characters, else 0 (so some rows are rewarded and advantages are not all zero)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str.strip()) <= 3)
