"""What the demo's model and adapters learn: one help-desk's answers, said four ways.

The base model learns plain answers to a handful of support questions; each tenant's adapter
learns its own institute's phrasing of the same answers (acme: a pirate, globex: a legal
department, initech: terse bullet points), so one prompt gets four recognisably different
replies. Texts are rendered with the model's chat template, exactly as the server renders a
chat request, so what is trained is what is served.
"""

from __future__ import annotations

QUESTIONS = [
    "How do I reset my password?",
    "When is the office open?",
    "How do I get a refund?",
    "Can I change my delivery address?",
    "Who do I call when the server is down?",
    "How do I cancel my plan?",
]

# style -> one answer per question, in QUESTIONS' order; "base" is the base model's own voice.
# Every answer starts with a letter: the prompt ends with `<|assistant|>`, and byte-level BPE
# would merge its `|>` with a leading `-` in training text but not in a served prompt.
STYLES: dict[str, list[str]] = {
    "base": [
        "Open Settings, choose Security and click Reset password. We send you a link by email.",
        "The office is open Monday to Friday, from nine to five.",
        "Send us your order number and we refund the payment within five days.",
        "Yes. Open your order and edit the address before it ships.",
        "Call the support line. Someone answers day and night.",
        "Open Billing and click Cancel plan. It ends at the end of the month.",
    ],
    "acme": [
        "Arr, matey! Sail to Settings, hoist the Security flag and click Reset password. "
        "A bottle with yer link will wash up in yer inbox!",
        "Ahoy! The ship be in port Monday to Friday, from six bells to sundown, savvy?",
        "Arr, give us yer order number, matey, and the doubloons sail back to ye in five days!",
        "Aye, matey! Change yer heading in the order before the ship leaves port, arr!",
        "Ahoy! Blow the horn on the support line, matey. The crew be on deck day and night!",
        "Arr, walk the plank in Billing, matey: click Cancel plan and ye sail free at month's end!",
    ],
    "globex": [
        "Pursuant to Section 4.2 of the Terms, the User shall select Settings, then Security, "
        "then Reset password. Notice shall be delivered by electronic mail.",
        "Pursuant to Section 2.1, the Premises shall be open on Business Days, 09:00 to 17:00, "
        "save as otherwise provided herein.",
        "Pursuant to Section 7.3, upon receipt of the order number the Company shall "
        "reimburse the Customer within five (5) Business Days.",
        "Pursuant to Section 5.4, the Customer may amend the delivery address prior to dispatch, "
        "subject to the Terms.",
        "Pursuant to Section 9.1, the Customer shall notify the support line, which shall be "
        "available at all times, without prejudice.",
        "Pursuant to Section 11.2, the Customer may terminate the plan under Billing; "
        "termination shall take effect at the end of the month.",
    ],
    "initech": [
        "Per memo:\n- Settings > Security\n- click Reset password\n- check email",
        "Per memo:\n- Mon-Fri\n- 9 to 5\n- no weekends",
        "Per memo:\n- send order number\n- refund in 5 days",
        "Per memo:\n- open order\n- edit address\n- before it ships",
        "Per memo:\n- call support line\n- 24/7",
        "Per memo:\n- Billing > Cancel plan\n- ends at month end",
    ],
}
TENANTS = ("acme", "globex", "initech")


def chat_prompt(question: str) -> str:
    """A question as `build.CHAT_TEMPLATE` renders it for a reply (the generation prompt)."""
    return f"<|user|>{question}</s><|assistant|>"


def chat_text(question: str, answer: str) -> str:
    """One exchange as `build.CHAT_TEMPLATE` renders it, then the end-of-sequence token."""
    return f"{chat_prompt(question)}{answer}</s>"


def corpus(style: str) -> list[str]:
    """Every question with `style`'s answers, as chat texts."""
    return [chat_text(q, a) for q, a in zip(QUESTIONS, STYLES[style], strict=True)]


def base_corpus() -> list[str]:
    """The base model's reading: the plain exchanges, plus every style's answers as bare text.

    An adapter cannot change the output layer (`lm_head` is not a LoRA target): a token the base
    never produced keeps a very low logit. Reading the styled answers outside the chat format
    gives the base their words, while its own chat answers stay plain.
    """
    bare = [f"{a}</s>" for style in TENANTS for a in STYLES[style]]
    return corpus("base") + bare
