"""A vLLM-style offline script: every sampling option of vLLM's offline API that m3serve serves.

Runs on CPU with the embedded model (`LLM()` with no arguments); with vLLM itself only the import line and the
model argument change (`from vllm import LLM, SamplingParams`, `LLM(model=...)`).

    python examples/vllm_style.py
"""

from __future__ import annotations

from m3serve import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    tokenizer = llm.get_tokenizer()
    banned = tokenizer.encode(" the", add_special_tokens=False)[0]

    # n samples per prompt out of best_of candidates, penalties, bias, min_tokens, logprobs of output and prompt
    params = SamplingParams(n=2, best_of=3, temperature=0.8, top_p=0.95, top_k=50, seed=0, max_tokens=32,
                            min_tokens=8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias={banned: -100.0}, logprobs=2, prompt_logprobs=1, stop=["\n\n"],
                            include_stop_str_in_output=True, skip_special_tokens=True)
    for out in llm.generate(["Once upon a time", "The sea was calm and"], params):
        first = out.prompt_logprobs[1]
        tok = out.prompt_token_ids[1]
        print(f"prompt {out.prompt!r}: {len(out.prompt_token_ids)} tokens, "
              f"logprob of prompt token 1 = {first[tok].logprob:.3f}")
        for c in out.outputs:
            assert banned not in c.token_ids and len(c.token_ids) >= 8
            top = c.logprobs[0]
            best = max(top.values(), key=lambda lp: lp.logprob)
            print(f"  [{c.index}] cumulative_logprob={c.cumulative_logprob:.2f} finish={c.finish_reason} "
                  f"first token top-1 {best.decoded_token!r} ({best.logprob:.2f}) text={c.text!r}")

    # special tokens in the text, stop token ids, greedy
    eos = tokenizer.eos_token_id
    raw = SamplingParams(temperature=0.0, max_tokens=16, skip_special_tokens=False,
                         spaces_between_special_tokens=False, stop_token_ids=[eos], include_stop_str_in_output=True)
    print("raw:", repr(llm.generate("Once upon a time", raw, use_tqdm=False)[0].outputs[0].text))

    # chat: one conversation, then a batch of two
    conversation = [{"role": "system", "content": "You are a poet."},
                    {"role": "user", "content": "Write a line about the sea."}]
    chat_params = SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.1)
    reply = llm.chat(conversation, chat_params, use_tqdm=False)[0]
    print("chat:", repr(reply.outputs[0].text))
    replies = llm.chat([conversation, conversation[1:]], chat_params, use_tqdm=False, add_generation_prompt=True)
    print("chat batch:", [r.outputs[0].finish_reason for r in replies])


if __name__ == "__main__":
    main()
