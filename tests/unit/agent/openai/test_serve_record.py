"""An episode's recorded calls as training rows (flowrl/serve/record.py): one row while each
prompt extends the last context, a new row where the history was rewritten."""

from flowrl.serve.record import Call, Recorder, broadcast, segments


def call(prompt, completion, version=0):
    return Call(prompt, completion, [-0.1 * (k + 1) for k in range(len(completion))], version)


def test_calls_that_extend_the_context_make_one_row():
    # prompt [1 2 3], the model says [10 11 EOS=2]; the agent adds a tool turn [7 8] and asks again
    first = call([1, 2, 3], [10, 11, 2])
    second = call([1, 2, 3, 10, 11, 2, 7, 8], [12, 2], version=1)
    (row,) = segments([first, second])
    assert row.prompt_ids == [1, 2, 3]
    assert row.ids == [10, 11, 2, 7, 8, 12, 2]
    assert row.mask == [1, 1, 1, 0, 0, 1, 1]  # the tool turn is attended to, not trained
    assert row.logprobs == [-0.1, -0.2, -0.30000000000000004, 0.0, 0.0, -0.1, -0.2]
    assert row.versions == [0, 1] and row.calls == 2


def test_a_rewritten_history_starts_a_new_row():
    first = call([1, 2, 3], [10, 11, 2])
    # the template re-rendered the assistant turn as [10, 99, 2]: the model never saw that
    second = call([1, 2, 3, 10, 99, 2, 7], [12, 2])
    third = call([1, 2, 3, 10, 99, 2, 7, 12, 2, 5], [13])  # extends the second
    rows = segments([first, second, third])
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [1, 2, 3, 10, 99, 2, 7]]
    assert rows[0].ids == [10, 11, 2] and rows[0].mask == [1, 1, 1]
    assert rows[1].ids == [12, 2, 5, 13] and rows[1].mask == [1, 1, 0, 1]
    # every sampled token is trained exactly once
    sampled = sum(len(c.completion_ids) for c in (first, second, third))
    assert sum(sum(r.mask) for r in rows) == sampled


def test_a_prompt_that_only_shares_a_prefix_is_a_break():
    rows = segments([call([1, 2, 3], [4, 2]), call([1, 2], [5])])
    assert len(rows) == 2 and rows[1].prompt_ids == [1, 2]


def test_episode_values_broadcast_to_their_rows():
    # two episodes of a group: scores 1 and 0; the first split in 3 rows
    assert broadcast([0.5, -0.5], [3, 1]) == [0.5, 0.5, 0.5, -0.5]


def test_recorder_keeps_episodes_apart():
    recorder = Recorder()
    recorder.add("a", [1], [2], [-0.5], 0, "stop")
    recorder.add("b", [3], [4], [-0.25], 1, "length")
    recorder.add("a", [1, 2, 9], [5], [-0.1], 0, "stop")
    a = recorder.take("a")
    assert [c.prompt_ids for c in a] == [(1,), (1, 2, 9)]
    assert recorder.take("a") == [] and recorder.take("b")[0].version == 1


def test_an_episode_that_breaks_becomes_one_row_per_segment():
    """program_rows with 2 slots: an episode whose history was rewritten trains both segments
    (each its own row: the row's prompt, the rest of the segment's prompt attended to, then
    its calls), an unbroken one fills its second slot with an empty row; every row of an
    episode carries its reward and share 1/2; a third segment is counted dropped."""
    from flowrl.serve.program_rows import program_rows
    from flowrl.serve.programs import Outcome
    from flowrl.testing import tiny_tokenizer

    first = call([1, 2, 3], [10, 11, 2])
    second = call([1, 2, 3, 10, 99, 2, 7], [12, 2], version=1)  # a rewritten history
    broken = Outcome(reward=1.0, calls=[first, second])
    whole = Outcome(reward=0.0, calls=[call([1, 2, 3], [20, 2])])
    out = program_rows([broken, whole], [[1, 2, 3]] * 2, tiny_tokenizer(), 0, "reward", slots=2)
    mask, responses = out["response_mask"], out["responses"]
    assert mask.shape[0] == 4
    assert responses[0, :3].tolist() == [10, 11, 2] and mask[0].sum() == 3
    assert responses[1, :6].tolist() == [10, 99, 2, 7, 12, 2]  # the segment's own context
    assert mask[1, :6].tolist() == [0, 0, 0, 0, 1, 1]
    assert mask[2].sum() == 2 and mask[3].sum() == 0  # the whole episode, then an empty slot
    assert out["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out["episode_share"].tolist() == [0.5] * 4
    infos = out["rollout_info"]
    assert [i["segment"] for i in infos] == [0, 1, 0, 1]
    assert [i["segments_dropped"] for i in infos] == [0, 0, 0, 0]
    # every sampled token trained exactly once
    assert int(mask.sum()) == sum(len(c.completion_ids) for c in (first, second)) + 2
    third = call([1, 2, 3, 5], [6])
    more = Outcome(reward=1.0, calls=[first, second, third])
    out = program_rows([more], [[1, 2, 3]], tiny_tokenizer(), 0, "reward", slots=2)
    assert out["rollout_info"][0]["segments_dropped"] == 1
    one = program_rows([more], [[1, 2, 3]], tiny_tokenizer(), 0, "reward")  # the default
    assert len(one["response_mask"]) == 1 and "episode_share" not in one
    assert one["rollout_info"][0]["segments_dropped"] == 2
