"""A scorer for tiny random models (`flowrl run --tiny`, flowrl.testing): a random model never
answers a task right, so a task's own scorer gives every row 0 and every advantage 0; scoring
by length gives varied scores, so advantages, losses and gradients are not zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """(len(solution_str) mod 3) / 2 in {0, 0.5, 1}, plus the length as an extra metric."""
    return {"score": (len(solution_str) % 3) / 2.0, "length": float(len(solution_str))}
