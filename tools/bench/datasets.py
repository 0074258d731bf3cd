"""Seeded cross-chunk texts for the patch benchmark.

A case is a short "register" A that names 6–8 entities (people with roles, or numbered
visitors) and gives each a few attributes, then a narrative B that speaks of the same entities
only indirectly: by role ("the harbour master"), by ordinal ("the second visitor"), by a
description that only A explains ("the one who keeps the tide log", "the painter from
Eastford"), or by pronoun. B states new facts (numbers, times, places). The queries ask about
those facts by the entity's name, which appears only in A, so answering needs both chunks.
Two extra chunks continue B in the same world, for experiments that reorder the chunks after A.

Everything is drawn from `random.Random(seed)`: a seed always gives the same case. The sizes
(about 200 SmolLM2 tokens for A, 400 for B, 150 per extra chunk) come from fixed sentence
counts and templates of similar length, not from any tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

# Sentence counts that set the chunk sizes (tuned on the SmolLM2 tokenizer; see the tests).
A_SENTENCES = 18  # opening + 2 per entity + extra attribute sentences up to this count
B_EVENTS = 13  # each event sentence is followed by one pronoun sentence
EXTRA_EVENTS = 5  # two extra chunks of about 150 tokens
ALT_REF_PROBABILITY = 0.2


@dataclass(frozen=True)
class Case:
    """One benchmark text: register `a`, narrative `b`, name-based queries, two extra chunks."""

    seed: int
    a: str
    b: str
    queries: tuple[str, ...]
    extra_chunks: tuple[str, ...]


@dataclass(frozen=True)
class _Entity:
    """A person of the world: named in A, referred to indirectly everywhere else."""

    name: str
    female: bool
    ref: str  # "the harbour master", "the second visitor"
    alt_ref: str  # a description only A explains
    own: str  # an object A says they keep
    store: str  # where A says they keep it

    @property
    def pron(self) -> str:
        """Subject pronoun."""
        return "she" if self.female else "he"

    @property
    def obj(self) -> str:
        """Object pronoun."""
        return "her" if self.female else "him"

    @property
    def poss(self) -> str:
        """Possessive determiner."""
        return "her" if self.female else "his"


# ---------------------------------------------------------------------------------------------
# Word lists. Person names are kept apart from every other list so that a name never appears
# in B by accident.

FEMALE_NAMES = ["Anja", "Maren", "Ilse", "Petra", "Sofia", "Noor", "Greta", "Leonie", "Mira",
                "Hanna", "Ingrid", "Clara", "Elif", "Rosa", "Yara", "Dagny", "Ottilie", "Freya",
                "Lucia", "Vera"]
MALE_NAMES = ["Tomas", "Jonas", "Emil", "Pavel", "Ruben", "Anton", "Lars", "Mateo", "Karim",
              "Felix", "Oskar", "Bruno", "Henrik", "Nils", "Viktor", "Teodor", "Aldo", "Joram",
              "Idris", "Casper"]
SURNAMES = ["Roth", "Berg", "Lindqvist", "Moreau", "Castell", "Petrov", "Haddad", "Novak",
            "Ferreira", "Takeda", "Brennan", "Varga", "Kowalski", "Nilsen", "Duarte", "Okafor",
            "Hartmann", "Sorensen", "Alvarez", "Quist", "Marchetti", "Dvorak", "Ekberg", "Voss",
            "Larkin", "Mendes", "Sato", "Falk", "Horvath", "Ibsen"]

# Role -> the object that role keeps.
ROLES = {
    "harbour master": "tide log", "village doctor": "medicine bag",
    "schoolteacher": "class register", "baker": "sourdough starter",
    "lighthouse keeper": "brass telescope", "blacksmith": "heaviest hammer",
    "mayor": "town seal", "librarian": "card catalogue", "ferry captain": "ship's log",
    "innkeeper": "guest book", "station master": "railway timetable",
    "carpenter": "set of chisels", "beekeeper": "honey ledger", "clockmaker": "jeweller's loupe",
    "pharmacist": "poison register", "bell ringer": "tower key", "head gardener": "seed catalogue",
    "miller": "grain ledger", "tailor": "pattern book", "shepherd": "lambing diary",
}
VISITOR_JOBS = ["glassblower", "surveyor", "painter", "botanist", "cartographer", "photographer",
                "engineer", "violinist", "spice merchant", "journalist", "geologist", "bookbinder"]
VISITOR_OBJECTS = ["wooden camera", "roll of maps", "violin case", "sketchbook",
                   "box of rock samples", "leather satchel", "brass compass", "field microscope",
                   "travelling trunk", "bundle of letters", "tin of paints", "pair of binoculars"]
ORDINALS = ["first", "second", "third"]
VILLAGES = ["Kelby", "Ostwick", "Thornhill", "Saltmere", "Greyhaven", "Ashcombe", "Penmoor",
            "Wrenfield", "Dunmore", "Elderby", "Caldmouth", "Harrowgate"]
TOWNS = ["Eastford", "Norbridge", "Lowton", "Redcastle", "Halden", "Westmere", "Brackley",
         "Farholm", "Stonebury", "Millbrook", "Ravensby", "Cresford"]
KINDS = ["fishing", "market", "mining", "river", "farming", "harbour", "hill", "mill"]
GEOS = ["north coast", "open moor", "river bank", "hillside", "lake shore", "old railway line",
        "forest edge", "estuary"]
COLOURS = ["red", "green", "yellow", "white", "grey", "blue", "orange", "black", "purple", "brown"]
CONTAINERS = ["cabinet", "chest", "cupboard", "drawer", "tin box", "trunk", "basket", "wardrobe",
              "crate", "safe"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["half past six", "seven o'clock", "a quarter to nine", "noon", "ten past four",
         "half past two", "eight in the evening", "a quarter past ten", "five o'clock",
         "twenty to eleven", "nine in the morning", "midnight"]
SPOTS = ["old pier", "market square", "church steps", "north gate", "railway bridge",
         "fish market", "school yard", "mill pond", "town hall", "bus shelter", "boat shed",
         "village green"]
GOODS = ["crates of apples", "sacks of flour", "barrels of tar", "coils of rope",
         "baskets of eggs", "boxes of nails", "rolls of cloth", "jars of honey", "bags of coal",
         "loaves of bread"]
THINGS = ["garden fence", "rowing boat", "chapel bell", "front gate", "weather vane",
          "garden shed", "wooden bench", "well cover", "signal lamp", "harbour crane"]
ITEMS = ["woollen coat", "second-hand bicycle", "copper kettle", "pair of boots", "fishing net",
         "brass lamp", "ladder", "wall clock", "wheelbarrow", "saddle"]
PLANTS = ["apple trees", "rose bushes", "rows of beans", "tulip bulbs", "hazel saplings",
          "cabbages", "lavender plants", "oak seedlings", "potato plants", "sunflowers"]
WEATHERS = ["dry", "windy", "grey", "warm", "foggy", "cold", "bright", "damp"]
FOODS = ["fish soup", "rye bread", "plum cake", "lentil stew", "smoked herring", "apple pie",
         "goat cheese", "pea soup"]
TRAITS = ["loud laugh", "careful handwriting", "patience", "bad jokes", "quick temper",
          "good memory", "long walks", "neat clothes"]
INSTRUMENTS = ["fiddle", "accordion", "flute", "piano", "guitar", "trumpet"]
DRINKS = ["black tea", "strong coffee", "warm milk", "mint tea", "cider"]
FEARS = ["deep water", "thunder", "horses", "heights", "the dark", "wasps"]

# ---------------------------------------------------------------------------------------------
# A's templates: the only place names appear.

A_OPENINGS = [
    "{village} is a small {kind} town on the {geo}.",
    "This is a register of {village}, a {kind} town on the {geo}.",
    "The town of {village} lies on the {geo}.",
    "What follows describes {village}, a {kind} town.",
    "{village} is an old {kind} town, and these are its people.",
    "Here are the people of {village}, a {kind} town.",
    "Few maps show {village}, a {kind} town on the {geo}.",
    "These people live in or visit {village}, a {kind} town.",
    "On the {geo} sits {village}, a small {kind} town.",
    "{village}, a {kind} town, has these residents and guests.",
]
ROLE_INTROS = [
    "The {role} is {name}.",
    "{name} works as the {role}.",
    "The {role} of {village} is {name}.",
    "{name} is the {role}.",
    "The {role} post is held by {name}.",
    "Everyone knows {name}, the {role}.",
    "{name} has been the {role} since {year}.",
    "The job of {role} belongs to {name}.",
    "{name} serves as the {role}.",
    "The {role} here is called {name}.",
]
VISITOR_INTROS = [
    "The {ordinal} visitor was {name}, a {job} from {town}.",
    "{name}, a {job} from {town}, was the {ordinal} visitor.",
    "The {ordinal} visitor is {name}, a {job} from {town}.",
    "Next came the {ordinal} visitor, {name}, a {job} from {town}.",
    "{name} was the {ordinal} visitor, a {job} from {town}.",
    "The {ordinal} visitor, {name}, is a {job} from {town}.",
    "{name}, the {ordinal} visitor, is a {job} from {town}.",
    "As the {ordinal} visitor came {name}, a {job} from {town}.",
    "{name} arrived as the {ordinal} visitor, a {job} from {town}.",
    "The {ordinal} visitor to arrive was {name} from {town}, a {job}.",
]
KEEPS = [
    "{pron} keeps the {own} in {store}.",
    "The {own}, kept in {store}, belongs to {obj}.",
    "{pron} stores the {own} in {store}.",
    "In {store} {pron} keeps the {own}.",
    "{poss} {own} stays in {store}.",
    "{pron} looks after the {own}, kept in {store}.",
    "{pron} leaves the {own} in {store}.",
    "{poss} {own} lives in {store}.",
    "{pron} locks the {own} in {store}.",
    "Only {pron} opens {store}, where the {own} is kept.",
]
ATTRIBUTES = [
    "{pron} was born in {town}.",
    "{pron} is {age} years old.",
    "{pron} speaks {small} languages.",
    "{poss} favourite food is {food}.",
    "{pron} has {small} children and a dog.",
    "{pron} is known for {poss} {trait}.",
    "{pron} wears a {colour} coat in all weather.",
    "{pron} plays the {instrument} in the evenings.",
    "{pron} is afraid of {fear}.",
    "{pron} drinks {drink} every morning.",
    "{pron} rides a {colour} bicycle.",
]

# ---------------------------------------------------------------------------------------------
# B's templates. Each event is (sentence, question); {ref} is the subject, {ref2} another entity.
# Questions name the subject ({name}) and ask for the fact the sentence states.

EVENTS = [
    ("at {time}, {ref} counted {num} {goods} at the {spot}.",
     "How many {goods} did {name} count at the {spot}?"),
    ("{ref} repaired the {thing} on {day}, using {num} new nails.",
     "What did {name} repair on {day}?"),
    ("{ref} paid {num} coins for a {item} at the {spot}.",
     "How many coins did {name} pay for the {item}?"),
    ("{ref} painted the {thing} {colour}, which took {num} hours.",
     "What colour did {name} paint the {thing}?"),
    ("{ref} took a train to {town} at {time}, carrying {num} letters.",
     "Where did {name} go by train at {time}?"),
    ("{ref} found {num} {goods} hidden near the {spot}.",
     "What did {name} find near the {spot}?"),
    ("{ref} sold a {item} to a trader from {town} for {num} coins.",
     "What did {name} sell to the trader from {town}?"),
    ("on {day}, {ref} walked {num} miles to {town} to buy a {item}.",
     "Where did {name} walk to on {day}?"),
    ("{ref} gave a talk at the {spot} at {time} to {num} people.",
     "Where did {name} give a talk at {time}?"),
    ("{ref} lost the {own} near the {spot} and searched for {num} minutes.",
     "Where did {name} lose the {own}?"),
    ("at {time}, {ref} moved the {own} from {store} to the {spot}.",
     "Where did {name} move the {own} to?"),
    ("{ref} planted {num} {plants} beside the {spot} on {day}.",
     "What did {name} plant beside the {spot}?"),
    ("{ref} rang the bell at the {spot} {num} times at {time}.",
     "How many times did {name} ring the bell at the {spot}?"),
    ("{ref} sent {num} pages to the council about the {thing}.",
     "What did {name} write to the council about?"),
    ("at {time}, {ref} met {ref2} at the {spot}.",
     "Whom did {name} meet at the {spot}?"),
    ("{ref} lent the {own} to {ref2} for {num} days.",
     "To whom did {name} lend the {own}?"),
    ("{ref} and {ref2} carried {num} {goods} to the {spot} on {day}.",
     "What did {name} carry to the {spot} on {day}?"),
    ("on {day}, {ref} paid back the {num} coins that {pron} owed {ref2}.",
     "To whom did {name} pay back {num} coins?"),
]
FOLLOW_UPS = [
    "{pron} wrote it all down in a notebook before going home.",
    "{pron} did not tell anyone in town the reason.",
    "{pron} was back at the {spot} by {time}.",
    "{pron} had not done that for {num} years.",
    "{pron} seemed very pleased with the result.",
    "afterwards {pron} put the receipt with the {own}.",
    "{pron} said it had been a long and tiring day.",
    "nobody in {village} asked {obj} about it.",
    "then {pron} went to check on the {own}.",
    "{pron} hummed an old song the whole time.",
    "the weather stayed {weather} while {pron} worked.",
    "later {pron} told {ref2} all about it.",
    "{pron} went home for {food} straight after.",
    "{pron} kept the details to {obj}self.",
    "by {time} {pron} was too tired to talk.",
    "{pron} asked {ref2} for help, but got none.",
    "{pron} promised to do it again next {day}.",
    "a few people stopped to watch {obj} at work.",
    "{pron} needed {small} cups of {drink} afterwards.",
    "{pron} did it all without a single complaint.",
]
OPENERS = ["early that morning,", "soon afterwards,", "later that day,", "around midday,",
           "in the afternoon,", "meanwhile,", "before supper,", "after the rain stopped,",
           "that evening,", "the next day,", "on the same day,", "a little later,"]
B_OPENINGS = [
    "{day} began {weather} in {village}, and everyone was busy.",
    "It was a {weather} {day} in {village}, a busy one.",
    "The week in {village} started on a {weather} {day}.",
    "On a {weather} {day}, the town of {village} woke early.",
    "Nobody in {village} will forget that {weather} {day}.",
    "The story begins in {village} on a {weather} {day}.",
    "That {day} the sky over {village} was {weather}.",
    "Much happened in {village} during that {weather} week.",
    "Here is what happened in {village} after that {weather} {day}.",
    "The {weather} {day} brought plenty of work to {village}.",
]
EXTRA_OPENINGS = [
    "Other things happened in {village} that week.",
    "There is more to tell about the week in {village}.",
    "Elsewhere in {village}, the work went on.",
    "Not everything that week happened at once.",
    "Some days later, {village} was busy again.",
    "Another part of the week in {village} went like this.",
    "The week in {village} held a few more events.",
    "Away from the crowds, {village} had its own small news.",
    "A few other people in {village} kept busy too.",
    "Here is another part of the story of {village}.",
]


class _Deck:
    """Draws from a list without repeats until every item is used, then reshuffles."""

    def __init__(self, rng: random.Random, items: list) -> None:
        self._rng = rng
        self._items = list(items)
        self._left: list = []

    def draw(self, accept: Callable[[Any], bool] = lambda item: True) -> Any:
        """The next acceptable item; reshuffles when none of the remaining ones is acceptable."""
        for attempt in range(2):
            if not self._left or attempt:
                self._left = self._rng.sample(self._items, len(self._items))
            for i, item in enumerate(self._left):
                if accept(item):
                    return self._left.pop(i)
        raise ValueError("no acceptable item in the deck")


@dataclass
class _World:
    """Everything one case draws from: the seeded generator, the town, its people, the decks."""

    rng: random.Random
    village: str
    people: list[_Entity]
    decks: dict[str, _Deck] = field(default_factory=dict)

    def draw(self, name: str, items: list, accept: Callable[[Any], bool] = lambda item: True) -> Any:
        """Draw from the deck `name` (made from `items` on first use), so texts vary within a case."""
        if name not in self.decks:
            self.decks[name] = _Deck(self.rng, items)
        return self.decks[name].draw(accept)


def _cap(sentence: str) -> str:
    """The sentence with its first letter upper-cased."""
    return sentence[:1].upper() + sentence[1:]


def _store(rng: random.Random) -> str:
    """Where something is kept, e.g. "the blue cabinet"."""
    return f"the {rng.choice(COLOURS)} {rng.choice(CONTAINERS)}"


def _people(rng: random.Random) -> list[_Entity]:
    """6–8 entities: some office holders, then two or three numbered visitors."""
    count = rng.randint(6, 8)
    visitors = rng.choice([2, 3])
    firsts_f = rng.sample(FEMALE_NAMES, count)
    firsts_m = rng.sample(MALE_NAMES, count)
    surnames = rng.sample(SURNAMES, count)
    roles = rng.sample(sorted(ROLES), count - visitors)
    jobs = rng.sample(VISITOR_JOBS, visitors)
    towns = rng.sample(TOWNS, visitors)
    objects = rng.sample(VISITOR_OBJECTS, visitors)
    people = []
    for i in range(count):
        female = rng.random() < 0.5
        name = f"{(firsts_f if female else firsts_m)[i]} {surnames[i]}"
        if i < len(roles):
            own = ROLES[roles[i]]
            ref, alt = f"the {roles[i]}", f"the one who keeps the {own}"
        else:
            v = i - len(roles)
            own = objects[v]
            ref, alt = f"the {ORDINALS[v]} visitor", f"the {jobs[v]} from {towns[v]}"
        people.append(_Entity(name, female, ref, alt, own, _store(rng)))
    return people


def _is_visitor(person: _Entity) -> bool:
    """Whether A introduces `person` as a numbered visitor rather than by role."""
    return person.ref.endswith(" visitor")


def _visitor_fields(person: _Entity) -> dict:
    """Ordinal, job and town of a visitor, recovered from its references."""
    ordinal = person.ref.split()[1]
    job, town = person.alt_ref[len("the "):].split(" from ")
    return {"ordinal": ordinal, "job": job, "town": town}


def _common(world: _World) -> dict:
    """Fresh random values for every slot a template may use."""
    rng = world.rng
    return {
        "village": world.village, "town": rng.choice(TOWNS), "day": rng.choice(DAYS),
        "time": rng.choice(TIMES), "spot": rng.choice(SPOTS), "goods": rng.choice(GOODS),
        "thing": rng.choice(THINGS), "item": rng.choice(ITEMS), "plants": rng.choice(PLANTS),
        "colour": rng.choice(COLOURS), "weather": rng.choice(WEATHERS),
        "num": rng.randint(3, 60), "small": rng.randint(2, 5), "age": rng.randint(24, 78),
        "year": rng.randint(1961, 2019), "food": rng.choice(FOODS), "trait": rng.choice(TRAITS),
        "instrument": rng.choice(INSTRUMENTS), "drink": rng.choice(DRINKS),
        "fear": rng.choice(FEARS), "kind": rng.choice(KINDS), "geo": rng.choice(GEOS),
    }


def _person_fields(person: _Entity) -> dict:
    """Slots that describe the person a sentence is about."""
    return {"name": person.name, "pron": person.pron, "obj": person.obj, "poss": person.poss,
            "own": person.own, "store": person.store}


def _introduction(world: _World, person: _Entity, extra: int) -> list[str]:
    """A's sentences about one person: who they are, what they keep where, `extra` attributes."""
    f = {**_common(world), **_person_fields(person)}
    if _is_visitor(person):
        intro = world.draw("visitor", VISITOR_INTROS).format(**{**f, **_visitor_fields(person)})
    else:
        intro = world.draw("role", ROLE_INTROS).format(**f, role=person.ref[len("the "):])
    sentences = [intro, world.draw("keeps", KEEPS).format(**f)]
    sentences += [world.draw("attribute", ATTRIBUTES).format(**f) for _ in range(extra)]
    return sentences


def _register(world: _World) -> str:
    """Chunk A: an opening, then for each person an introduction and what they keep where,
    then extra attribute sentences spread over people up to `A_SENTENCES` sentences."""
    people = world.people
    extra = max(0, A_SENTENCES - 1 - 2 * len(people))
    extra_for = [0] * len(people)
    for i in world.rng.sample(range(len(people)), min(extra, len(people))):
        extra_for[i] += 1
    sentences = [world.draw("a_opening", A_OPENINGS).format(**_common(world))]
    for person, n_extra in zip(people, extra_for):
        sentences += _introduction(world, person, n_extra)
    return " ".join(_cap(s) for s in sentences)


def _subjects(world: _World, count: int) -> list[_Entity]:
    """Who each event is about: everyone once (shuffled), then random people."""
    people = world.people
    order = world.rng.sample(people, len(people))
    return (order + [world.rng.choice(people) for _ in range(count)])[:count]


def _reference(world: _World, person: _Entity) -> str:
    """An indirect reference: the role/ordinal, sometimes a description only A explains."""
    return person.alt_ref if world.rng.random() < ALT_REF_PROBABILITY else person.ref


def _follow_up(world: _World, person: _Entity, other: _Entity, event_text: str) -> str:
    """A pronoun sentence about `person` after an event; never mentions an object the event moved."""
    accept = (lambda t: "{own}" not in t) if "{own}" in event_text else (lambda t: True)
    template = world.draw("follow_up", FOLLOW_UPS, accept)
    return _cap(template.format(**_common(world), **_person_fields(person), ref2=other.ref))


def _event(world: _World, person: _Entity, used: set) -> tuple[str, str]:
    """One event sentence (plus a pronoun follow-up) about `person`, and its question.

    `used` holds (name, template index) pairs already told, so no person gets the same kind of
    event twice and every question has one answer.
    """
    index = world.draw("event", range(len(EVENTS)), lambda i: (person.name, i) not in used)
    used.add((person.name, index))
    other = world.rng.choice([p for p in world.people if p is not person])
    text, question = EVENTS[index]
    f = {**_common(world), **_person_fields(person), "ref2": _reference(world, other)}
    # "The one who keeps the tide log lent the tide log" says the object twice: use the role.
    f["ref"] = person.ref if "{own}" in text else _reference(world, person)
    sentence = text.format(**f)
    if "{time}" not in text and "{day}" not in text and world.rng.random() < 0.5:
        sentence = f"{world.draw('opener', OPENERS)} {sentence}"
    return f"{_cap(sentence)} {_follow_up(world, person, other, text)}", question.format(**f)


def _narrative(world: _World, openings: str, events: int,
               used: set) -> tuple[str, list[tuple[_Entity, str]]]:
    """A chunk of `events` events after an opening sentence (from the list named `openings`);
    returns it and the (person, question) of each event."""
    templates = B_OPENINGS if openings == "b_opening" else EXTRA_OPENINGS
    parts = [_cap(world.draw(openings, templates).format(**_common(world)))]
    asked = []
    for person in _subjects(world, events):
        text, question = _event(world, person, used)
        parts.append(text)
        asked.append((person, question))
    return " ".join(parts), asked


def _queries(asked: list[tuple[_Entity, str]], people: list[_Entity]) -> tuple[str, ...]:
    """One query per person: the question of the first event B tells about them."""
    first: dict[str, str] = {}
    for person, question in asked:
        first.setdefault(person.name, question)
    return tuple(f" Question: {first[p.name]} Answer:" for p in people)


def make_case(seed: int) -> Case:
    """The case for `seed`: same seed, same texts."""
    rng = random.Random(seed)
    village = rng.choice(VILLAGES)
    world = _World(rng, village, _people(rng))
    a = _register(world)
    used: set = set()
    b, asked = _narrative(world, "b_opening", B_EVENTS, used)
    extras = tuple(_narrative(world, "extra_opening", EXTRA_EVENTS, used)[0] for _ in range(2))
    return Case(seed=seed, a=a, b=b, queries=_queries(asked, world.people), extra_chunks=extras)
