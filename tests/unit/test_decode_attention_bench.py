"""decode_attention's slot layouts: the KV pool's, for requests decoding together."""
from specserve.bench.decode_attention import decode_slots


def test_the_free_list_order_interleaves_the_decoded_tokens():
    slots = decode_slots(batch=3, prompt=2, decoded=2, page_size=1, runs=False)
    assert slots == [[0, 1, 6, 9], [2, 3, 7, 10], [4, 5, 8, 11]]


def test_with_runs_each_request_decodes_into_one_run():
    slots = decode_slots(batch=3, prompt=5, decoded=40, page_size=1)
    for request in slots:
        assert request == list(range(request[0], request[0] + 45))
    every = [slot for s in slots for slot in s]
    assert len(set(every)) == len(every)


def test_pages_hold_one_request_each_and_runs_stay_whole():
    batch, prompt, decoded, page = 4, 5, 19, 8
    slots = decode_slots(batch, prompt, decoded, page)
    assert [len(s) for s in slots] == [prompt + decoded] * batch
    every = [slot for s in slots for slot in s]
    assert len(set(every)) == len(every)                      # no slot given twice
    owners = {}
    for b, s in enumerate(slots):
        for i, slot in enumerate(s):
            assert owners.setdefault(slot // page, b) == b     # a page belongs to one request
            assert slot % page == i % page                     # token i at offset i % page_size
