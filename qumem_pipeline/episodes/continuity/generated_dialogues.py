"""A second out-of-domain segmentation set, generated: whole user–assistant task dialogues, joined.

Why: the LoCoMo-joined set (:mod:`.ood_data`) is chit-chat between two people, like TIAGE. The
product's own input is user–assistant conversations, where one dialogue is a task (a recipe, a
trip, a bug) that runs from the request to the thanks, and a new task starts a new episode. No
dataset of that kind is available to this project under a license it may use for training, so this
builds one from templates written here (nothing copied from any corpus): 24 everyday assistant tasks,
each with its own openers, slot values, questions, answers, confirmations and closings.

Construction (deterministic for a seed):

1. the domains are split by a seeded permutation into ``calib`` and ``eval`` halves, so the eval
   half measures tasks the decision rule was never chosen on;
2. per split, ``n_dialogues`` joined dialogues of 3–6 whole task dialogues, consecutive ones from
   different domains; each task dialogue is an opener, 1–4 question/answer exchanges, a
   confirmation and (usually) a thanks/goodbye pair, speakers alternating — 4 to 12 utterances;
3. the reference boundary is exactly each join, as in sets built by joining whole dialogues.

Output: the common "segments" format, like :mod:`.ood_data`.
"""

from __future__ import annotations

import re

import numpy as np

from qumem_pipeline.episodes.dialogues import Dialogue, parse_segments

BUILDER_VERSION = "assistant-tasks-v1"
DEFAULT_SEED = 0
SPLITS = ("calib", "eval")
TASKS_PER_DIALOGUE = (3, 6)

# Each domain: slots (name -> values), openers (user), exchanges (assistant question, user answers),
# confirmations (assistant). {slot} fields are filled from the domain's slots.
DOMAINS: dict[str, dict] = {
    "recipe": {
        "slots": {"dish": ["lasagna", "a vegetable curry", "banana bread", "pad thai", "a lentil soup"],
                  "n": ["two", "four", "six"], "diet": ["vegetarian", "gluten-free", "dairy-free", "no restrictions"]},
        "open": ["Can you give me a recipe for {dish}?", "I want to cook {dish} tonight, how do I make it?",
                 "What do I need to make {dish}?"],
        "ask": [("How many people are you cooking for?", ["For {n} people.", "{n}, including me."]),
                ("Any dietary restrictions I should know about?", ["Make it {diet}.", "{diet}, please."]),
                ("Do you want the oven or the stovetop version?", ["The stovetop one, my oven is broken.", "Oven is fine."])],
        "confirm": ["Here is a {diet} recipe for {dish} for {n}: prep takes 20 minutes and cooking about 40.",
                    "Great, the {dish} needs onions, garlic, and a good pan; simmer it for half an hour."],
    },
    "flight": {
        "slots": {"city": ["Lisbon", "Denver", "Osaka", "Nairobi", "Oslo"], "day": ["Friday", "next Monday", "the 14th"],
                  "seat": ["a window seat", "an aisle seat", "any seat"]},
        "open": ["I need a flight to {city} on {day}.", "Find me cheap flights to {city}.", "Can you check flights to {city} for {day}?"],
        "ask": [("Where are you flying from?", ["From Chicago.", "I'm leaving from Boston."]),
                ("Do you prefer a morning or evening departure?", ["Morning, as early as possible.", "Evening works better."]),
                ("Any seat preference?", ["{seat}, please.", "I'd like {seat}."]),
                ("Is this one way or a return trip?", ["Return, back a week later.", "Just one way."])],
        "confirm": ["The cheapest option to {city} on {day} leaves at 7:40 with one stop, and I noted {seat}.",
                    "I found a direct flight to {city} on {day} for 320 dollars."],
    },
    "wifi": {
        "slots": {"device": ["my laptop", "my phone", "the smart TV", "my printer"], "router": ["Netgear", "TP-Link", "the provider's"]},
        "open": ["My wifi keeps dropping on {device}.", "{device} won't connect to the internet anymore.",
                 "Why is my internet so slow on {device}?"],
        "ask": [("Have you tried restarting the router?", ["Yes, twice already.", "No, let me try that."]),
                ("What router do you have?", ["It's a {router} router.", "{router}, about three years old."]),
                ("Do other devices connect fine?", ["Yes, only {device} has the problem.", "No, everything is slow."])],
        "confirm": ["Try forgetting the network on {device} and reconnecting, then update the {router} firmware.",
                    "It sounds like interference; switch the {router} router to the 5 GHz band."],
    },
    "workout": {
        "slots": {"goal": ["build strength", "run a 10k", "lose some weight", "improve flexibility"], "days": ["three", "four", "five"]},
        "open": ["Can you make me a workout plan? I want to {goal}.", "I'd like to {goal} in the next two months.",
                 "Help me plan my training so I can {goal}."],
        "ask": [("How many days a week can you train?", ["About {days} days.", "{days} days at most."]),
                ("Do you have access to a gym?", ["Yes, a small one at work.", "No, only at home."]),
                ("Any injuries I should plan around?", ["My left knee hurts sometimes.", "None right now."])],
        "confirm": ["Here is a {days}-day plan to {goal}: two strength sessions, one long easy session and rest days between.",
                    "Start with short sessions {days} days a week and add ten percent each week so you can {goal}."],
    },
    "budget": {
        "slots": {"income": ["3,000", "4,500", "2,200"], "goal": ["an emergency fund", "a new car", "a vacation"]},
        "open": ["Help me set up a monthly budget.", "I want to save for {goal}, where do I start?",
                 "How should I split my paycheck each month?"],
        "ask": [("What is your monthly take-home pay?", ["About {income} dollars.", "Roughly {income} after taxes."]),
                ("What are your fixed costs like rent and bills?", ["Rent is 1,100 and bills about 300.", "Around half my income."]),
                ("What are you saving for?", ["For {goal}.", "Mostly {goal}."])],
        "confirm": ["With {income} a month, put 50 percent to needs, 30 to wants and 20 toward {goal}.",
                    "Set an automatic transfer on payday so {goal} grows before you spend."],
    },
    "code_bug": {
        "slots": {"lang": ["Python", "JavaScript", "Go", "Rust"], "err": ["an index out of range error", "a null pointer error", "a timeout"]},
        "open": ["My {lang} script crashes with {err}.", "I'm getting {err} in my {lang} code, can you help?",
                 "Why would {lang} throw {err} here?"],
        "ask": [("Can you paste the line where it fails?", ["It's in the loop over the results list.", "The line that reads items[i + 1]."]),
                ("Which version are you running?", ["The latest {lang} release.", "An older one from last year."]),
                ("Does it fail on every input?", ["Only on empty inputs.", "Only with large files."])],
        "confirm": ["The loop reads one past the end; check the length before indexing and {err} goes away.",
                    "Add a guard for the empty case before the loop, that is what triggers {err} in {lang}."],
    },
    "email": {
        "slots": {"to": ["my landlord", "my manager", "a client", "my professor"], "topic": ["a late payment", "a deadline extension", "a refund"]},
        "open": ["Can you draft an email to {to} about {topic}?", "I need to write to {to} about {topic}.",
                 "Help me word a message to {to} regarding {topic}."],
        "ask": [("Should the tone be formal or friendly?", ["Formal, please.", "Friendly but professional."]),
                ("What outcome do you want?", ["I want them to agree to {topic}.", "Just to explain the situation."]),
                ("Any dates I should mention?", ["Mention the end of the month.", "No dates needed."])],
        "confirm": ["Here is a draft: Dear {to}, I am writing about {topic}; thank you for considering my request.",
                    "Draft ready: a short note to {to} explaining {topic} and proposing a next step."],
    },
    "movie": {
        "slots": {"genre": ["thriller", "comedy", "documentary", "science fiction"], "mood": ["something light", "something intense", "a classic"]},
        "open": ["Recommend me a {genre} movie for tonight.", "What's a good {genre} to watch?", "I'm in the mood for {mood}, any movie ideas?"],
        "ask": [("Do you prefer recent films or older ones?", ["Recent, from the last five years.", "Older is fine."]),
                ("Are you watching alone or with others?", ["With my partner.", "Alone."]),
                ("Any streaming service you use?", ["We have Netflix.", "Whatever is on the big ones."])],
        "confirm": ["Try a tightly paced {genre} from 2021; it fits {mood} and runs under two hours.",
                    "For {mood}, a well reviewed {genre} that is streaming now would be my pick."],
    },
    "garden": {
        "slots": {"plant": ["tomatoes", "basil", "roses", "a lemon tree"], "space": ["a balcony", "a small backyard", "a windowsill"]},
        "open": ["My {plant} have yellow leaves, what's wrong?", "How do I grow {plant} on {space}?", "When should I plant {plant}?"],
        "ask": [("How much sun does the spot get?", ["About six hours a day.", "Only morning sun."]),
                ("How often do you water them?", ["Every day.", "Maybe twice a week."]),
                ("Are they in pots or in the ground?", ["In pots on {space}.", "In the ground."])],
        "confirm": ["Yellow leaves on {plant} usually mean too much water; let the soil dry between waterings.",
                    "On {space}, {plant} need a deep pot, full sun and a feed every two weeks."],
    },
    "car": {
        "slots": {"car": ["my Honda", "the old Ford", "my Toyota"], "noise": ["a squeal when braking", "a rattle at idle", "a clicking when turning"]},
        "open": ["{car} makes {noise}.", "There's {noise} coming from {car}, should I worry?", "What causes {noise} in a car?"],
        "ask": [("How many miles are on it?", ["About 90,000.", "Just over 120,000 miles."]),
                ("When did it start?", ["Last week.", "A couple of months ago."]),
                ("Does it happen when the engine is cold?", ["Mostly in the morning.", "All the time."])],
        "confirm": ["{noise} on {car} often points to worn pads or a loose heat shield; have a mechanic look this week.",
                    "Get it checked soon: {noise} can get worse quickly on a high mileage car."],
    },
    "pet": {
        "slots": {"pet": ["my puppy", "our cat", "my rabbit"], "issue": ["isn't eating", "scratches the furniture", "barks at night"]},
        "open": ["{pet} {issue}, what should I do?", "Any advice? {pet} {issue}.", "Why does {pet} keep doing this, it {issue}."],
        "ask": [("How old is your pet?", ["Eight months.", "About five years old."]),
                ("Has anything changed at home recently?", ["We moved last month.", "Nothing I can think of."]),
                ("Have you talked to a vet?", ["Not yet.", "Yes, they said it's behavioural."])],
        "confirm": ["Keep a steady routine and reward calm behaviour; if {pet} still {issue} in a week, see the vet.",
                    "That often settles with more exercise and a quiet space of its own."],
    },
    "language": {
        "slots": {"lang": ["Spanish", "Japanese", "German", "Portuguese"], "min": ["15", "30", "45"]},
        "open": ["I want to learn {lang}, how should I start?", "What's the fastest way to get conversational in {lang}?",
                 "Can you make me a study plan for {lang}?"],
        "ask": [("How much time can you study each day?", ["About {min} minutes.", "{min} minutes on weekdays."]),
                ("Have you studied {lang} before?", ["A little in school.", "Never."]),
                ("Do you learn better from apps or books?", ["Apps, on the train.", "Books and audio."])],
        "confirm": ["Spend {min} minutes a day: ten on vocabulary with spaced repetition, the rest listening and speaking {lang}.",
                    "Start with the 500 most common {lang} words and one short conversation a week."],
    },
    "return": {
        "slots": {"item": ["a jacket", "headphones", "a coffee maker"], "shop": ["the online store", "the mall shop", "a marketplace seller"]},
        "open": ["How do I return {item} I bought from {shop}?", "{item} arrived broken, can I get a refund?", "I want to send back {item}."],
        "ask": [("When did you buy it?", ["Two weeks ago.", "Last month."]),
                ("Do you still have the receipt?", ["Yes, the order email.", "I think I lost it."]),
                ("Is it unused and in its box?", ["Yes, unopened.", "I opened it to test it."])],
        "confirm": ["Most sellers like {shop} accept returns within 30 days; start it from your order page and print the label.",
                    "Ask {shop} for a refund for {item} with a photo of the damage; they usually send a prepaid label."],
    },
    "doctor": {
        "slots": {"symptom": ["a sore throat", "back pain", "headaches"], "when": ["tomorrow morning", "this week", "Thursday afternoon"]},
        "open": ["I need to book a doctor's appointment for {symptom}.", "Can you help me schedule a visit {when}?",
                 "I've had {symptom} for days, should I see someone?"],
        "ask": [("How long have you had the symptoms?", ["Four days now.", "Over a week."]),
                ("Do you have a fever?", ["A slight one.", "No fever."]),
                ("Which clinic do you usually go to?", ["The one near my office.", "The downtown clinic."])],
        "confirm": ["I'd book the clinic {when}; for {symptom} with no fever that is soon enough.",
                    "Call the clinic to book {when} and mention {symptom} so they give you the right slot."],
    },
    "book": {
        "slots": {"genre": ["fantasy", "history", "mystery", "popular science"], "liked": ["a long series", "short novels", "true stories"]},
        "open": ["Suggest a {genre} book for my holiday.", "I just finished a great {genre} book, what should I read next?",
                 "Any good {genre} reads lately?"],
        "ask": [("What was the last book you loved?", ["A detective story set in Venice.", "A book about the space race."]),
                ("Do you prefer {liked}?", ["Yes, {liked} suit me.", "Not really."]),
                ("E-book or paper?", ["Paper.", "E-book, it's for travel."])],
        "confirm": ["For {genre} and {liked}, pick an award-winning title from last year; it reads fast on holiday.",
                    "You'd enjoy a {genre} with a strong narrator; I can list three options."],
    },
    "moving": {
        "slots": {"city": ["Austin", "Glasgow", "Toronto"], "rooms": ["one bedroom", "two bedrooms", "a studio"]},
        "open": ["I'm moving to {city} next month, help me plan.", "What's a moving checklist for {rooms}?", "How do I organise a move to {city}?"],
        "ask": [("How big is your current place?", ["{rooms}.", "It's {rooms} with a small storage room."]),
                ("Will you hire movers?", ["Yes, if it's affordable.", "No, friends will help."]),
                ("Do you need to transfer utilities?", ["Yes, internet and power.", "Only internet."])],
        "confirm": ["Book movers four weeks ahead, pack one room a day, and set internet and power to start in {city} the day you arrive.",
                    "For {rooms}, plan on about 30 boxes and one full day of loading."],
    },
    "party": {
        "slots": {"who": ["my daughter's 8th birthday", "a retirement party", "a small dinner"], "guests": ["10", "25", "40"]},
        "open": ["Help me plan {who}.", "I'm hosting {who} for {guests} guests.", "What food should I serve at {who}?"],
        "ask": [("How many guests are coming?", ["About {guests}.", "{guests}, maybe a few more."]),
                ("Indoors or outdoors?", ["In the garden if it's sunny.", "Indoors."]),
                ("What's your budget?", ["Around 300.", "As cheap as possible."])],
        "confirm": ["For {guests} guests, plan finger food, one main dish and a cake; order drinks a week early.",
                    "Here's a timeline for {who}: invitations now, shopping three days before, set-up the morning of."],
    },
    "math": {
        "slots": {"topic": ["derivatives", "compound interest", "probability", "fractions"], "level": ["high school", "college", "my kid's homework"]},
        "open": ["Can you explain {topic}?", "I don't get {topic} at all.", "How do I solve problems with {topic}?"],
        "ask": [("What level is this for?", ["{level}.", "It's for {level}."]),
                ("Can you show me a problem you're stuck on?", ["The one with two dice.", "Finding the rate of change of x squared."]),
                ("Do you want a worked example?", ["Yes please.", "Just the idea first."])],
        "confirm": ["Here's {topic} step by step for {level}, with one worked example and two to try.",
                    "The key idea in {topic} is to break the problem into small steps; here's an example."],
    },
    "weather_trip": {
        "slots": {"place": ["the coast", "the mountains", "the city center"], "day": ["Saturday", "Sunday", "tomorrow"]},
        "open": ["Will it rain on {day}? We're going to {place}.", "What should I pack for {place} this {day}?", "Is {day} good for a hike in {place}?"],
        "ask": [("Are you staying overnight?", ["Just a day trip.", "One night."]),
                ("Morning or afternoon?", ["We leave early morning.", "Afternoon."]),
                ("Any activities planned?", ["A long walk.", "Mostly sightseeing."])],
        "confirm": ["Showers are likely on {day} afternoon in {place}; pack a light rain jacket and layers.",
                    "{day} looks dry and mild in {place}, a good day for it."],
    },
    "resume": {
        "slots": {"job": ["data analyst", "nurse", "project manager"], "years": ["two", "five", "ten"]},
        "open": ["Can you review my resume for a {job} job?", "How do I make my resume stand out for {job} roles?",
                 "I'm applying as a {job}, what should my CV say?"],
        "ask": [("How many years of experience do you have?", ["{years} years.", "About {years}."]),
                ("What's your biggest achievement?", ["I led a team that cut costs.", "I trained new staff."]),
                ("Is it one page now?", ["Two pages.", "Yes, one page."])],
        "confirm": ["Lead with a two-line summary, then results with numbers; {years} years fit on one page for a {job}.",
                    "Tailor the top third to the {job} posting and move older roles into one line each."],
    },
    "sleep": {
        "slots": {"hours": ["five", "six", "four"], "habit": ["coffee late", "my phone in bed", "late workouts"]},
        "open": ["I can't fall asleep at night.", "I only sleep {hours} hours, how do I sleep better?", "Why do I wake up at 3am every night?"],
        "ask": [("What time do you go to bed?", ["Around midnight.", "Usually 1am."]),
                ("Any habits before bed?", ["I have {habit}.", "Probably {habit}."]),
                ("How long has this been going on?", ["A few months.", "Since I started a new job."])],
        "confirm": ["Keep a fixed wake-up time, cut {habit}, and give yourself 30 minutes without screens before bed.",
                    "With {hours} hours a night, start by moving bedtime 15 minutes earlier each week."],
    },
    "tax": {
        "slots": {"form": ["a freelance income form", "a deduction for home office", "a late filing"], "year": ["last year", "2025"]},
        "open": ["I have a question about {form}.", "How do I handle {form} for {year}?", "Do I need to report {form}?"],
        "ask": [("Are you employed or self-employed?", ["Self-employed since {year}.", "Employed, with some side work."]),
                ("Do you use tax software?", ["Yes, the usual one.", "No, I file on paper."]),
                ("Did you keep receipts?", ["Most of them.", "Only some."])],
        "confirm": ["For {form}, keep receipts for every expense and report it in the self-employment section for {year}.",
                    "You can file {form} for {year} online; the penalty is small if you file soon."],
    },
    "photo": {
        "slots": {"camera": ["my phone", "an old DSLR", "a mirrorless camera"], "subject": ["night skies", "portraits", "birds"]},
        "open": ["How do I take better photos of {subject}?", "My pictures of {subject} come out blurry.", "Tips for shooting {subject} with {camera}?"],
        "ask": [("What camera are you using?", ["{camera}.", "Just {camera}."]),
                ("Do you have a tripod?", ["Yes, a cheap one.", "No."]),
                ("Do you shoot in auto mode?", ["Always auto.", "Sometimes manual."])],
        "confirm": ["For {subject} on {camera}, steady the camera, lower the shutter speed only as far as it stays sharp, and shoot in bursts.",
                    "Use a tripod and a two-second timer; most blur in {subject} shots is camera shake."],
    },
    "plumbing": {
        "slots": {"fixture": ["the kitchen sink", "the shower drain", "the toilet"], "problem": ["is clogged", "keeps leaking", "drains slowly"]},
        "open": ["{fixture} {problem}.", "How do I fix it when {fixture} {problem}?", "Any idea why {fixture} {problem}?"],
        "ask": [("Have you tried a plunger?", ["Yes, no luck.", "Not yet."]),
                ("How old is the plumbing?", ["The house is from the seventies.", "Fairly new."]),
                ("Is water pooling anywhere?", ["Under the cabinet.", "No, it's dry."])],
        "confirm": ["If {fixture} {problem}, try a drain snake first, then check the trap underneath.",
                    "Shut off the valve and replace the washer; that fixes most cases where {fixture} {problem}."],
    },
}

GREETINGS = ["", "Hi! ", "Hello, ", "Hey, ", "Good morning. "]
THANKS = ["Thanks, that's all I needed.", "Perfect, thank you!", "Great, thanks a lot.", "That helps, thanks.", "Okay, thank you."]
BYES = ["You're welcome, have a good day!", "Glad to help. Goodbye!", "Anytime, take care.", "Happy to help!"]
_SLOT = re.compile(r"\{(\w+)\}")


def _fill(text: str, values: dict[str, str]) -> str:
    out = _SLOT.sub(lambda m: values[m.group(1)], text)
    return out[0].upper() + out[1:] if out else out


def task_dialogue(domain: str, rng: np.random.Generator) -> list[str]:
    """One whole task dialogue of ``domain``: opener, 1–4 exchanges, confirmation, usually a closing."""
    d = DOMAINS[domain]
    values = {k: str(v[int(rng.integers(len(v)))]) for k, v in d["slots"].items()}
    utt = [GREETINGS[int(rng.integers(len(GREETINGS)))] + _fill(d["open"][int(rng.integers(len(d["open"])))], values)]
    n_ask = int(rng.integers(1, min(4, len(d["ask"])) + 1))
    for i in sorted(rng.choice(len(d["ask"]), size=n_ask, replace=False)):
        q, answers = d["ask"][int(i)]
        utt += [_fill(q, values), _fill(answers[int(rng.integers(len(answers)))], values)]
    utt.append(_fill(d["confirm"][int(rng.integers(len(d["confirm"])))], values))
    if rng.random() < 0.8:
        utt += [THANKS[int(rng.integers(len(THANKS)))], BYES[int(rng.integers(len(BYES)))]]
    return utt


def build_generated(seed: int = DEFAULT_SEED, n_dialogues: int = 40) -> dict[str, list[dict]]:
    """Both splits (domains disjoint between them), as "segments"-format records plus ``sources``."""
    rng = np.random.default_rng(seed)
    halves = _domain_halves(rng)
    return {split: _joined(halves[split], split, n_dialogues, rng) for split in SPLITS}


def _domain_halves(rng: np.random.Generator) -> dict[str, list[str]]:
    """The task domains split into ``calib`` and ``eval`` by the generator's first draw."""
    names = sorted(DOMAINS)
    side = rng.permutation(len(names)) % 2
    return {split: [n for n, s in zip(names, side) if s == k] for k, split in enumerate(SPLITS)}


def build_generated_train(seed: int = DEFAULT_SEED, instance_seed: int = 1, n_dialogues: int = 40) -> list[dict]:
    """Training dialogues for the classifier: ``calib``'s task domains of ``seed`` only, filled and
    joined with ``instance_seed`` (other instances than ``calib``'s), so the eval half's domains stay
    unseen by a classifier trained on these."""
    domains = _domain_halves(np.random.default_rng(seed))["calib"]  # the same halves as build_generated
    return _joined(domains, "train", n_dialogues, np.random.default_rng([seed, instance_seed]))


def _joined(domains: list[str], split: str, n_dialogues: int, rng: np.random.Generator) -> list[dict]:
    """``n_dialogues`` joined dialogues of 3–6 task dialogues, consecutive ones from different domains."""
    records = []
    for j in range(n_dialogues):
        want = int(rng.integers(TASKS_PER_DIALOGUE[0], TASKS_PER_DIALOGUE[1] + 1))
        parts: list[str] = []
        for _ in range(want):
            choices = [x for x in domains if not parts or x != parts[-1]]
            parts.append(choices[int(rng.integers(len(choices)))])
        tasks = [task_dialogue(p, rng) for p in parts]
        records.append({"dial_id": f"gen-{split}-{j:03d}", "utterances": [u for t in tasks for u in t],
                        "segments": [len(t) for t in tasks], "sources": parts})
    return records


def generated_dialogues(split: str = "eval", seed: int = DEFAULT_SEED) -> list[Dialogue]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return parse_segments(build_generated(seed)[split]).dialogues


def generated_train_dialogues(seed: int = DEFAULT_SEED, instance_seed: int = 1) -> list[Dialogue]:
    return parse_segments(build_generated_train(seed, instance_seed)).dialogues
