"""A scorer for tiny random models: varied scores so advantages (and gradients) are nonzero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (len(solution_str) % 3) / 2.0, "length": float(len(solution_str))}
