"""Streamed chunks against the final text when the engine loop runs ahead of the caller's thread:
the chunk builder may see output text that already holds a whole stop string before it sees the
finish, and must not send what lies past it."""

from __future__ import annotations

import queue

from jspec.runtime import outputs
from jspec.runtime.detokenizer import DetokState, Detokenizer, safe_prefix
from jspec.runtime.request import Request
from jspec.runtime.sampling_params import SamplingParams


def _request(stop: str) -> Request:
    req = Request(rid="r", input_ids=[1, 2], sampling=SamplingParams(stop=[stop]), seed=0, stream=True)
    req.stream_queue = queue.Queue()
    req.detok_state = DetokState()
    return req


def test_a_chunk_never_sends_text_past_a_whole_stop_string_seen_before_the_finish():
    req = _request("6 w96")
    gen = outputs.stream(Detokenizer(None), req, speculative=False)
    # The loop decoded two tokens (the stop is complete in them) and woke the stream once...
    req.output_ids += [96, 96]
    req.detok_state.text = "w96 w96"
    req.stream_queue.put(False)
    first = next(gen)
    # ...then matched the stop and finished it before the caller asked for the next chunk.
    req.stop_text_end = 2
    req.finish_reason = {"type": "stop", "matched": "6 w96"}
    req.stream_queue.put(True)
    rest = list(gen)
    assert first["text"] == "w9" and first["meta_info"]["finish_reason"] is None
    assert "".join(c["text"] for c in [first] + rest) == "w9"
    assert rest[-1]["meta_info"]["finish_reason"]["matched"] == "6 w96"


def test_a_tail_that_may_become_a_stop_string_waits_and_is_sent_when_it_does_not():
    req = _request("6 w96")
    gen = outputs.stream(Detokenizer(None), req, speculative=False)
    req.output_ids += [96]
    req.detok_state.text = "w96"
    req.stream_queue.put(False)
    assert next(gen)["text"] == "w9"  # "6" may begin the stop
    req.output_ids += [5]
    req.detok_state.text = "w96 w5"
    req.stream_queue.put(False)
    assert next(gen)["text"] == "6 w5"


def test_the_sendable_text_searched_from_what_was_sent_equals_the_whole_search():
    """A stream searches for whole stops only past what it sent (which held no stop and no start
    of one); grown character by character, every step's answer equals the search from the start."""
    text = "ab xx 12-34 tail STOP after 56-78 end"
    for stops, patterns in ((["STOP"], ()), ([], (r"[0-9]{2}-[0-9]{2}",)), (["xx"], (r"t[a-z]il",)),
                            ([], (r"e.*d",))):  # unbounded: held whole
        sent = ""
        for n in range(len(text) + 1):
            now = text[:n]
            whole = safe_prefix(now, stops, patterns)
            assert safe_prefix(now, stops, patterns, len(sent)) == whole, (stops, patterns, now)
            sent = max(sent, whole, key=len)


def test_without_stop_strings_the_reader_decodes_and_the_pieces_add_up():
    """No stop strings: the engine loop keeps no text for the request (its detok_state stays None)
    and the stream decodes the new ids itself, chunk by chunk, to the same final text; with
    detokenize=False the chunks carry ids and no text."""
    from tokenizers import decoders

    from tests.support.models import word_tokenizer

    tok = word_tokenizer({f"w{i}": i for i in range(50)}, unk="w0")
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    detok = Detokenizer(tok)
    for detokenize in (True, False):
        req = Request(rid="r", input_ids=[1, 2], sampling=SamplingParams(), seed=0, stream=True)
        req.stream_queue = queue.Queue()
        chunks = outputs.StreamChunks(detok, req, speculative=False, detokenize=detokenize)
        pieces = []
        for new in ([3, 4], [], [5], [], [6, 7, 8]):  # signals coalesce: some find no new token
            req.output_ids += new
            chunk = chunks.next(False)
            assert (chunk is None) == (not new)
            pieces += [chunk] if chunk is not None else []
        req.finish_reason = {"type": "length", "length": 6}
        pieces.append(chunks.next(True))
        assert req.detok_state is None
        assert [t for p in pieces for t in p["output_ids"]] == [3, 4, 5, 6, 7, 8]
        whole = "".join(p["text"] for p in pieces)
        assert whole == ("w3 w4 w5 w6 w7 w8" if detokenize else "")
        if detokenize:
            assert pieces[0]["text"].startswith("w3") and pieces[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_signals_held_for_a_step_reach_their_queues_in_order_in_one_wake_up():
    """Signals put by another thread (the engine loop) inside `batched_signals` arrive on the event
    loop, each stream's in order, in one hand-over at the block's end; outside one, each is handed
    over at once; a closed loop takes nothing and the putting thread goes on."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe

    def counted(*args):
        wakeups.append(args)
        return real(*args)

    loop.call_soon_threadsafe = counted

    async def main():
        signals = [outputs.LoopSignal(loop) for _ in range(8)]
        got = [[] for _ in signals]

        def engine():  # three steps, every stream signalled once a step; then one signal outside a step
            for step in range(3):
                with outputs.batched_signals():
                    for s in signals:
                        s.put(False)
                    with outputs.batched_signals():  # nested: held for the outer block
                        s.put(False)
                    assert len(wakeups) == step
            signals[0].put(True)

        async def read(i):
            while True:
                final = await signals[i].queue.get()
                got[i].append(final)
                if len(got[i]) == {0: 4, 7: 6}.get(i, 3):  # stream 7 also got the nested puts
                    return

        t = threading.Thread(target=engine)
        t.start()
        t.join()
        await asyncio.gather(*(read(i) for i in range(8)))
        return got

    try:
        got = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got[0] == [False, False, False, True] and got[1:7] == [[False] * 3] * 6 and got[7] == [False] * 6
    assert len(wakeups) == 4  # three steps, then the one outside

    closed = asyncio.new_event_loop()
    signal = outputs.LoopSignal(closed)
    closed.close()
    signal.put(False)
    with outputs.batched_signals():
        signal.put(True)
