"""The soak test's scorer: varied scores for a tiny random model, and a failure on about 5% of
rows. Which rows fail depends only on the row (a hash of the response), so a resumed run and an
uninterrupted one see the same failures."""

import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digest = hashlib.sha256(solution_str.encode()).digest()
    if digest[0] < 13:  # 13 / 256 = 5.1% of rows
        raise RuntimeError(f"flaky scorer: failing on purpose ({digest[:2].hex()})")
    return (len(solution_str) % 3) / 2.0
