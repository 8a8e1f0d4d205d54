"""``tokenmill serve --speculative-method ngram``: the same text as without speculation, streamed
as accepted runs arrive, and vLLM's spec_decode metrics (``tokenmill:`` prefix)."""

from __future__ import annotations

from tests.test_server_support import MODEL, metrics, server_fixtures

server, client = server_fixtures("--speculative-method", "ngram", "--prompt-lookup-min", "1",
                                 "--dtype", "float32")
plain_server, plain_client = server_fixtures("--dtype", "float32")

PASSAGE = ("The paged KV cache keeps every sequence's keys and values in fixed-size blocks, "
           "and a block table maps each position of a sequence to its block.")
MESSAGES = [{"role": "user", "content": f"Repeat this sentence exactly:\n\n{PASSAGE}"}]


def chat_text(client, **extra) -> str:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                         temperature=0.0, **extra)
    return out.choices[0].message.content


def test_same_text_with_and_without_speculation(server, client, plain_client):
    assert chat_text(client) == chat_text(plain_client)


def test_streaming_delivers_the_same_text(server, client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                            temperature=0.0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat_text(client)
    assert len([p for p in pieces if p]) > 1


def test_spec_decode_metrics(server, client):
    chat_text(client)
    m = metrics(server.url)
    drafts = m[("tokenmill:spec_decode_num_draft_tokens_total", ())]
    accepted = m[("tokenmill:spec_decode_num_accepted_tokens_total", ())]
    verifications = m[("tokenmill:spec_decode_num_drafts_total", ())]
    assert drafts > 0 and 0 < accepted <= drafts and 0 < verifications <= drafts
    assert m[("tokenmill:spec_decode_draft_acceptance_rate", ())] == accepted / drafts
    assert m[("tokenmill:spec_decode_mean_accepted_length", ())] == \
        1 + accepted / verifications
    per_pos = [v for (name, labels), v in m.items()
               if name == "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_no_spec_metrics_without_speculation(plain_server, plain_client):
    assert not [k for k in metrics(plain_server.url) if "spec_decode" in k[0]]
