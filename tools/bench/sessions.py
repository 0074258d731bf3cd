"""Generated chat sessions for `agentwin bench sessions`: what users' windows see, from seeds.

A session is a chat-formatted window (`agentwin.chat.Chat`): a pinned system head, then parts
appended one at a time under a token budget, the oldest evicted first (FIFO, as the window's
budget evicts), some evicted parts recalled (revisits), and a question after every step. Four
kinds, each with its own format:

- `notes`: prose paragraphs of facts about people and places in a town; a recalled paragraph
  goes back to its old slot (right after the head: every part after it moves);
- `doc`: pages of a technical handbook with a markdown table and a configuration snippet
  (code); a recalled page goes to the end of the window, as the document navigator recalls;
- `web`: pages of a small web site as text (title, navigation, prose, a price list); a
  revisited page goes to the end of the window, as the web agent recalls;
- `video`: captions of consecutive video segments (time stamps, objects, colours, counts); a
  recalled segment goes back to its old slot (the window stays in time order);
- `thread`: a running account (meeting minutes of a harbour crew) whose entries refer back to
  people by role and pronoun: who "the harbour master" is was said in an earlier entry, maybe
  one that has left the window, so a part's meaning leans on parts before it; a recalled entry
  goes back to its old slot.

Questions ask about facts of the session, mostly of parts in view, some of parts that left it,
and after a recall about the recalled part. Every text comes from the seed; nothing is tuned to
a method. The session is a `tools.bench.trace.Trace` per model (the budget and the evictions
depend on the model's tokenizer): chunk 0 is the head, evictions are written before the append
or recall that needs the room, and each "decide" holds the chat question as its query.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agentwin.chat import Chat
from tools.bench.trace import Trace
from agentwin.eviction import Fifo

KINDS = ("notes", "doc", "web", "video", "thread")
VALIDATION_SEEDS = (0,)
TEST_SEEDS = (1, 2, 3)
READS = 30  # per session in the full run
QUICK_READS = 6
IN_VIEW = 4.0  # parts the budget holds besides the head, on average

FIRST = ["Mira", "Tobias", "Ines", "Karl", "Lena", "Oskar", "Ada", "Jonas", "Vera", "Emil", "Rosa", "Felix",
         "Nadia", "Pavel", "Greta", "Hugo", "Ilse", "Bruno", "Clara", "Dario", "Elsa", "Anton", "Lotte", "Milo"]
LAST = ["Olsen", "Mertens", "Vogel", "Brandt", "Keller", "Haas", "Lund", "Sorensen", "Weber", "Falk", "Roth",
        "Berger", "Novak", "Ibsen", "Moreau", "Dahl", "Winter", "Krause", "Aalto", "Fischer"]
PLACES = ["Dock Street", "the old mill", "Harbour Lane", "the market square", "Birch Road", "the ferry pier",
          "Castle Hill", "the north gate", "Linden Alley", "the fish hall", "Quarry Way", "the lighthouse"]
TRADES = [("bakery", "rye bread"), ("bicycle shop", "repairs"), ("pharmacy", "cough syrup"),
          ("bookshop", "sea charts"), ("tea room", "mint tea"), ("smithy", "iron hinges"),
          ("dairy", "goat cheese"), ("tailor", "wool coats"), ("fish stall", "smoked eel"),
          ("print shop", "posters"), ("pottery", "blue bowls"), ("clock shop", "pocket watches")]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "grey", "purple", "brown"]
ANIMALS = ["dog", "cat", "goat", "horse", "heron", "fox", "crow", "sheep"]
VEHICLES = ["van", "bus", "bicycle", "truck", "tractor", "taxi", "scooter", "boat"]
PARTS = ["filter", "valve", "pump seal", "fan belt", "pressure gauge", "intake grille", "drain hose",
         "bearing", "control board", "float switch"]
UNITS = ["pump station", "boiler room", "cooling tower", "water tank", "generator", "heat exchanger"]
BOOKS = ["Atlas of Tides", "The Salt Road", "Winter Harbour", "Knots and Lines", "The Lamp Keeper",
         "North Sea Birds", "Ferries of the Coast", "The Glass Float", "Storm Log", "Small Boats"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


@dataclass(frozen=True)
class Fact:
    """One question a part answers, and its answer."""

    question: str
    answer: str


@dataclass(frozen=True)
class Part:
    text: str
    facts: tuple[Fact, ...]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


ROLES = ["harbour master", "ferry captain", "lighthouse keeper", "net mender", "dock clerk", "pilot"]
TASKS = [("repainted", "repainting", "the north buoy"), ("inspected", "inspecting", "the crane"),
         ("counted", "counting", "the empty crates"), ("locked", "locking", "the fuel shed"),
         ("moved", "moving", "the spare nets"), ("signed", "signing", "the tide log"),
         ("repaired", "repairing", "the jetty rail"), ("ordered", "ordering", "new rope"),
         ("cleaned", "cleaning", "the signal lamp"), ("tested", "testing", "the fog horn")]


def thread_part(rng: random.Random, index: int, cast: list[tuple[str, str, str]]) -> Part:
    """An entry of the crew's minutes; entry 0 introduces the crew, later ones name people by role
    or pronoun only."""
    if index == 0:
        intro = "; ".join(f"{name} is the {role}" for name, role, _ in cast)
        text = f"Minutes of the harbour crew, week {rng.randint(1, 52)}. Present: {intro}."
        name, role, _ = cast[0]
        return Part(text, (Fact(f"Who is the {role}?", name), Fact(f"What is {name}'s job?", f"the {role}")))
    name, role, pronoun = rng.choice(cast)
    (verb, doing, thing), (verb2, _, thing2) = rng.sample(TASKS, 2)
    day, hour = rng.choice(DAYS), rng.randint(6, 18)
    text = (f"Entry {index}: on {day} the {role} {verb} {thing} at {hour}:00. Afterwards {pronoun} {verb2} "
            f"{thing2}, and asked for the minutes to say so.")
    facts = (Fact(f"Who {verb} {thing} on {day}?", name), Fact(f"At what time was {thing} {verb}?", f"{hour}:00"),
             Fact(f"What did the {role} do after {doing} {thing}?", f"{verb2} {thing2}"))
    return Part(text, facts)


def notes_part(rng: random.Random, index: int) -> Part:
    owner, (trade, goods), place = _person(rng), rng.choice(TRADES), rng.choice(PLACES)
    year, price, hour = rng.randint(1990, 2024), rng.randint(2, 40), rng.randint(5, 11)
    friend, pet = _person(rng), rng.choice(ANIMALS)
    text = (f"{owner} runs the {trade} on {place} and has done so since {year}. "
            f"The {trade} opens at {hour} in the morning; its {goods} cost {price} crowns. "
            f"{owner.split()[0]} keeps a {rng.choice(COLOURS)} {pet} behind the counter, and "
            f"{friend} helps out on {rng.choice(DAYS)}s.")
    facts = (Fact(f"Who runs the {trade} on {place}?", owner),
             Fact(f"Since which year has {owner} run the {trade}?", str(year)),
             Fact(f"How much do the {goods} at the {trade} on {place} cost?", f"{price} crowns"),
             Fact(f"Who helps out at {owner}'s {trade}?", friend))
    return Part(text, facts)


def doc_part(rng: random.Random, index: int) -> Part:
    unit, page = rng.choice(UNITS), 3 + index
    rows = rng.sample(PARTS, 3)
    months = [rng.choice([1, 2, 3, 6, 12]) for _ in rows]
    people = [_person(rng) for _ in rows]
    speed, mode, limit = rng.randint(20, 90), rng.choice(["eco", "boost", "night", "auto"]), rng.randint(2, 9)
    table = "\n".join(f"| {p} | every {m} month{'s' if m > 1 else ''} | {who} |" for p, m, who in zip(rows, months, people))
    key = unit.replace(" ", "_")
    text = (f"Page {page}: maintenance of the {unit}\n\n| part | interval | contact |\n|---|---|---|\n{table}\n\n"
            f"Settings file for the {unit}:\n```\n{key}.speed = {speed}\n{key}.mode = \"{mode}\"\n"
            f"{key}.max_restarts = {limit}\n```")
    facts = (Fact(f"How often is the {rows[0]} of the {unit} serviced?", f"every {months[0]} months"),
             Fact(f"Who is the contact for the {rows[1]} of the {unit}?", people[1]),
             Fact(f"What is {key}.speed set to?", str(speed)),
             Fact(f"Which mode does the {unit} run in?", mode))
    return Part(text, facts)


def web_part(rng: random.Random, index: int) -> Part:
    shop, owner, place = f"{rng.choice(LAST)} Books", _person(rng), rng.choice(PLACES)
    first, last = rng.sample(DAYS, 2)
    opens, closes = rng.randint(8, 11), rng.randint(16, 20)
    books = rng.sample(BOOKS, 3)
    prices = [rng.randint(8, 45) for _ in books]
    pages = ["Home", "Events", "Books", "Contact"]
    name = rng.choice(pages)
    lines = "\n".join(f"- {b}: {p} EUR" for b, p in zip(books, prices))
    text = (f"# {shop} | {name}\nNavigation: " + " | ".join(pages) + "\n\n"
            f"{shop} is a bookshop on {place}, run by {owner}. We are open {first} to {last}, "
            f"{opens}:00 to {closes}:00.\n\nThis week's prices:\n{lines}")
    facts = (Fact(f"Who runs {shop}?", owner),
             Fact(f"How much is {books[0]} at {shop}?", f"{prices[0]} EUR"),
             Fact(f"At what time does {shop} close?", f"{closes}:00"),
             Fact(f"Where is {shop}?", place))
    return Part(text, facts)


def video_part(rng: random.Random, index: int) -> Part:
    t0 = index * 10
    colour, vehicle = rng.choice(COLOURS), rng.choice(VEHICLES)
    count, coat, animal = rng.randint(2, 9), rng.choice(COLOURS), rng.choice(ANIMALS)
    sign = f"{rng.choice(LAST)} Freight"
    text = (f"[{t0 // 60:02d}:{t0 % 60:02d}-{(t0 + 10) // 60:02d}:{(t0 + 10) % 60:02d}] "
            f"A {colour} {vehicle} stops by the gate; the sign on it reads '{sign}'. "
            f"A person in a {coat} coat unloads {count} crates. A {animal} crosses the yard from left to right.")
    facts = (Fact(f"What colour is the {vehicle} that says '{sign}'?", colour),
             Fact(f"How many crates are unloaded from the {sign} {vehicle}?", str(count)),
             Fact(f"What does the sign on the {colour} {vehicle} read?", sign),
             Fact(f"What colour is the coat of the person unloading the {sign} {vehicle}?", coat))
    return Part(text, facts)


MAKERS: dict[str, Callable[[random.Random, int], Part]] = {
    "notes": notes_part, "doc": doc_part, "web": web_part, "video": video_part}
PRONOUNS = ("she", "he")
SYSTEMS = {
    "notes": "You are a careful assistant. The user shares notes about a town, one paragraph at a time. "
             "Answer each question from the notes in a few words.",
    "doc": "You help technicians with a maintenance handbook. The user shows handbook pages. "
           "Answer each question from the pages in a few words.",
    "web": "You are a browsing assistant. The user shows the text of web pages as they are visited. "
           "Answer each question from the pages in a few words.",
    "video": "You watch a security camera with the user, who describes it segment by segment. "
             "Answer each question from the descriptions in a few words.",
    "thread": "You keep track of a harbour crew's minutes, which the user reads out entry by entry. "
              "Answer each question from the minutes in a few words.",
}
RECALL_AT_END = {"notes": False, "doc": True, "web": True, "video": False, "thread": False}


def session_parts(kind: str, seed: int, count: int) -> list[Part]:
    """The parts of one session, from its seed."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rng = random.Random(f"{kind}/{seed}")
    if kind == "thread":
        names = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], 3)
        cast = [(n, r, rng.choice(PRONOUNS)) for n, r in zip(names, rng.sample(ROLES, 3))]
        return [thread_part(rng, i, cast) for i in range(count)]
    return [MAKERS[kind](rng, i) for i in range(count)]


def make_session(kind: str, seed: int, km: Any, reads: int = READS, chat: Chat | None = None,
                 in_view: float = IN_VIEW) -> Trace:
    """One session as a `Trace` for `km`'s tokenizer (see the module docstring): `reads`
    questions, about a fifth of them after recalls of evicted parts; the budget holds the head and
    about `in_view` parts."""
    if isinstance(reads, bool) or not isinstance(reads, int) or reads < 3:
        raise ValueError(f"reads must be an int of at least 3, got {reads!r}")
    chat = chat if chat is not None else Chat(km)
    recalls = max(1, reads // 5)
    appends = reads - recalls
    parts = session_parts(kind, seed, appends)
    rng = random.Random(f"{kind}/{seed}/ops")
    head = chat.head(SYSTEMS[kind]).text
    texts = {0: head, **{i + 1: chat.part(p.text).text for i, p in enumerate(parts)}}
    sizes = {c: int(km.tokenize(t).numel()) for c, t in texts.items()}
    budget = sizes[0] + round(in_view * sum(sizes[c] for c in texts if c) / appends)
    # Recalls come after the window has slid, spread over the appends after the first slides.
    recall_after = sorted(rng.sample(range(min(appends - recalls, max(appends // 2, int(in_view) + 1)), appends),
                                     recalls))
    order: list[int] = []
    slots: dict[int, int] = {}
    ops: list[dict[str, Any]] = []
    step = 0

    def make_room(incoming: int) -> None:
        victims = Fifo().plan(order, sizes, {0}, incoming, budget)
        for victim in victims:
            slots[victim] = order.index(victim)
            order.remove(victim)
            ops.append({"op": "evict", "chunk": victim})

    def ask(about: int) -> None:
        nonlocal step
        fact = rng.choice(parts[about - 1].facts)
        ops.append({"op": "decide", "step": step, "query": chat.question(fact.question), "about": about,
                    "answer": fact.answer, "in_view": about in order})
        step += 1

    ops.append({"op": "append", "chunk": 0})
    order.append(0)
    for index in range(appends):
        chunk = index + 1
        make_room(sizes[chunk])
        ops.append({"op": "append", "chunk": chunk})
        order.append(chunk)
        seen = [c for c in range(1, chunk + 1)]
        in_view = [c for c in order if c]
        ask(rng.choice(in_view) if rng.random() < 0.75 or len(seen) == len(in_view) else
            rng.choice([c for c in seen if c not in order]))
        while recall_after and recall_after[0] == index:
            recall_after.pop(0)
            gone = [c for c in seen if c not in order]
            if not gone:
                continue
            back = rng.choice(gone)
            make_room(sizes[back])
            at = len(order) if RECALL_AT_END[kind] else min(slots.get(back, len(order)), len(order))
            at = max(at, 1)  # never before the pinned head
            ops.append({"op": "recall", "chunk": back, "at": at})
            order.insert(at, back)
            ask(back)
    meta = {"kind": kind, "seed": seed, "split": "validation" if seed in VALIDATION_SEEDS else "test",
            "parts": appends, "budget_tokens": budget, "head_tokens": sizes[0],
            "recall_at": "end" if RECALL_AT_END[kind] else "old slot"}
    return Trace(f"{kind}-s{seed}", budget, texts, ops, meta)


def make_sessions(km: Any, kinds: Sequence[str] = KINDS, seeds: Sequence[int] = VALIDATION_SEEDS + TEST_SEEDS,
                  reads: int = READS) -> list[Trace]:
    """Every kind x seed session for `km`."""
    chat = Chat(km)
    return [make_session(kind, seed, km, reads, chat) for kind in kinds for seed in seeds]
