"""Prose prompts: topics x templates (x a style note), and summaries of packages' module docstrings.

Topic groups and templates are both units of the held-out split (`prose/topics:GROUP`,
`prose/template:N`): a topic prompt belongs to its group and its template, and is held out when
either is. Docstring prompts belong to their package (`prose/docs:PACKAGE`), held out together with
that package's code prompts.
"""

from __future__ import annotations

TOPIC_GROUPS: dict[str, tuple[str, ...]] = {
    group: tuple(topic.strip() for topic in topics.split(";"))
    for group, topics in {
        "history": "the French Revolution; the Silk Road; the printing press; ancient Egyptian pyramids; "
        "the Roman Empire; the Industrial Revolution; the fall of the Berlin Wall; the Viking age; "
        "the Renaissance in Florence; the invention of writing; the Ottoman Empire; the Meiji era in Japan; "
        "the history of the bicycle; medieval castles; the first Olympic Games",
        "science": "photosynthesis; black holes; plate tectonics; the water cycle; DNA and genes; "
        "the theory of evolution; vaccines; the periodic table; electricity; magnetism; the speed of light; "
        "climate and weather; the human immune system; sound waves; chemical reactions in cooking",
        "cooking": "baking sourdough bread; making fresh pasta; fermenting vegetables; knife skills; "
        "cooking rice perfectly; making a simple curry; Japanese ramen; French sauces; grilling vegetables; "
        "vegetarian meal planning; making jam; brewing tea; roasting coffee; spices of India; "
        "cooking on a budget",
        "travel": "visiting Kyoto; backpacking in Patagonia; a train journey across Canada; Lisbon's old "
        "town; camping in national parks; travelling with children; packing light; the markets of "
        "Marrakech; Iceland's waterfalls; island hopping in Greece; road trips; travelling by night train; "
        "learning phrases before a trip; museums of Paris; hiking in the Alps",
        "sports": "marathon training; the rules of cricket; learning to swim; the history of football; "
        "rock climbing; chess strategy; cycling tours; yoga for beginners; basketball fundamentals; "
        "table tennis; the Tour de France; martial arts; stretching after exercise; team captaincy; "
        "rowing",
        "nature": "coral reefs; rainforests; migrating birds; mushrooms and fungi; deserts at night; "
        "tides; volcanoes; glaciers; wildflowers; the life of bees; old-growth forests; wetlands; "
        "caves; thunderstorms; the changing seasons",
        "health": "getting enough sleep; drinking enough water; posture at a desk; managing stress; "
        "walking every day; healthy breakfasts; first aid basics; hand washing; protecting your eyes from "
        "screens; building a habit; mindfulness; recovering from a cold; dental care; sun protection; "
        "balanced diets",
        "technology": "how the internet works; smartphones; electric cars; solar panels; 3D printing; "
        "public-key cryptography; search engines; open-source software; robots in factories; "
        "GPS navigation; computer memory; video compression; batteries; online privacy; "
        "the history of computers",
        "arts": "impressionist painting; learning to draw faces; origami; pottery; street art; "
        "photography composition; writing poetry; theatre rehearsals; the art of calligraphy; "
        "sculpture in stone; film editing; comic books; museum curation; knitting; architecture of bridges",
        "music": "learning the piano; jazz improvisation; how orchestras work; writing a song; "
        "the history of the guitar; rhythm and tempo; singing in a choir; electronic music; "
        "folk music traditions; music theory basics; practising an instrument; opera; drumming; "
        "the blues; recording music at home",
        "money": "making a monthly budget; saving for a goal; how interest works; starting a small "
        "business; comparing prices; understanding a payslip; avoiding debt; how banks work; "
        "what inflation means; buying a first car; pocket money for children; second-hand shopping; "
        "charity giving; price negotiation; tracking expenses",
        "work": "preparing for a job interview; writing a CV; working from home; running a good meeting; "
        "giving feedback; time management; asking for a raise; starting a new job; teamwork; "
        "public speaking; writing clear emails; changing careers; mentoring; taking breaks at work; "
        "planning a project",
        "home": "decluttering a room; growing tomatoes; composting; fixing a leaky tap; keeping "
        "houseplants alive; organising a kitchen; saving energy at home; painting a wall; moving house; "
        "cleaning with vinegar; building a bookshelf; caring for a lawn; living with roommates; "
        "home safety; seasonal cleaning",
        "education": "studying for exams; learning a second language; reading with children; taking "
        "good notes; homeschooling; online courses; memorisation techniques; group projects; "
        "the value of libraries; learning from mistakes; school uniforms; homework; teachers' jobs; "
        "learning to type; curiosity",
        "space": "the Moon landings; Mars rovers; the International Space Station; comets; "
        "how stars are born; the solar system; telescopes; astronauts' daily life; eclipses; "
        "the Big Bang; satellites; the northern lights; exoplanets; rockets; Saturn's rings",
        "animals": "octopuses; wolves and their packs; how cats communicate; training a puppy; "
        "elephants; penguins; ants and their colonies; whales' songs; owls; caring for a goldfish; "
        "horses; dolphins; butterflies' life cycle; crows' intelligence; tortoises",
        "environment": "recycling plastics; renewable energy; reducing food waste; clean rivers; "
        "urban gardens; electric public transport; planting trees; repairing instead of replacing; "
        "water conservation; air quality in cities; protecting endangered species; sustainable fashion; "
        "light pollution; beach clean-ups; local food",
        "everyday-life": "planning a birthday party; making friends in a new city; writing a thank-you "
        "note; morning routines; keeping a journal; hosting a dinner; choosing a gift; walking a dog in "
        "the rain; a rainy Sunday; talking to neighbours; learning to cook for one; weekend markets; "
        "board game nights; commuting by bike; visiting grandparents",
        "language": "the origins of English words; learning Spanish; sign language; idioms; "
        "writing a good story opening; punctuation; how children learn to speak; dialects; "
        "translation; the alphabet; poetry forms; persuasive writing; book clubs; dictionaries; "
        "storytelling around a fire",
        "ideas": "the scientific method; critical thinking; ethics of artificial intelligence; "
        "happiness; the meaning of friendship; decision making; probability in daily life; "
        "democracy; fairness; creativity; the value of boredom; optimism; patience; honesty; "
        "how habits form",
    }.items()
}
"""Topic group -> topics: about 300 topics across fields; a group is a unit of the held-out split."""

TEMPLATES = (
    "Write a short paragraph about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "What are the most interesting facts about {topic}?",
    "Write a short email to a friend telling them what you learned about {topic}.",
    "Give three common misconceptions about {topic} and correct them.",
    "Describe {topic} in five bullet points.",
    "Write the opening paragraph of a blog post about {topic}.",
    "Why do people find {topic} interesting? Answer in a few sentences.",
    "Write a short dialogue between a teacher and a student about {topic}.",
    "Summarise the key ideas of {topic} for a busy reader.",
    "Write three quiz questions about {topic}, with answers.",
    "Compare {topic} with something from everyday life, and explain the comparison.",
    "Write a short story for children that involves {topic}.",
    "What questions would an expert ask about {topic}? List five.",
    "Write a product description for a book about {topic}.",
    "Give a one-sentence definition of {topic}, then expand on it in a paragraph.",
    "Write a persuasive paragraph on why everyone should learn about {topic}.",
    "Write a tweet-length summary of {topic}.",
    "Write a limerick about {topic}.",
    "Describe how {topic} has changed over time.",
    "How would you explain {topic} to someone from the year 1800?",
    "Write a formal letter to a museum asking for an exhibition on {topic}.",
    "Write a short news report about a new discovery related to {topic}.",
    "Create a simple lesson plan to teach {topic} in one hour.",
    "Write a motivational message for someone who is starting to learn about {topic}.",
    "Give an analogy that makes {topic} easy to understand.",
    "Write a short FAQ about {topic} with four questions and answers.",
    "Describe a day in the life of someone whose work involves {topic}.",
    "Write a short speech introducing {topic} to a school assembly.",
    "Write a short poem in free verse about {topic}.",
    "List five words someone needs to talk about {topic}, each with a definition.",
    "Write a diary entry of someone experiencing {topic} for the first time.",
    "Give three tips for someone who wants to learn more about {topic}.",
    "Write a short review of an imaginary documentary about {topic}.",
    "Outline a five-paragraph essay about {topic}.",
    "What would the world be like without {topic}? Write a short reflection.",
    "Write a short debate: one person for and one against spending a school day on {topic}.",
    "Explain the most important thing a beginner should know about {topic}.",
    "Write a postcard from someone who has just discovered {topic}.",
    "Plan a weekend project that teaches a family about {topic}.",
)
"""Prose templates; index N is the held-out unit `prose/template:N`."""

STYLE_NOTES = (
    "",
    " Keep it under 100 words.",
    " Use simple words.",
    " Use a friendly tone.",
    " Write it in a formal style.",
    " Include one concrete example.",
    " Avoid jargon.",
    " End with a question for the reader.",
)
"""Appended to a topic prompt: a third axis of variety that is no split unit."""

DOC_TEMPLATES = (
    "Summarise in plain words:\n\n{text}",
    "Explain this description of a software module to someone new to programming:\n\n{text}",
    "Rewrite this paragraph so that it is easier to read:\n\n{text}",
    "What problem does this software module solve? Its description:\n\n{text}",
)
"""Prompts made of a module docstring's first paragraph (the `prose/docs:PACKAGE` source)."""


TOPICS: tuple[tuple[str, str], ...] = tuple(
    (group, topic) for group, members in TOPIC_GROUPS.items() for topic in members
)
"""(group, topic) pairs in order: the first axis of the topic prompt product."""

PRODUCT_SIZE = len(TOPICS) * len(TEMPLATES) * len(STYLE_NOTES)
"""Distinct topic prompts: every topic with every template and style note."""


def topic_prompt(index: int) -> tuple[str, tuple[str, ...]]:
    """The `index`-th prompt of the topic x template x style product, with its source groups."""
    rest, style = divmod(index, len(STYLE_NOTES))
    topic_index, template = divmod(rest, len(TEMPLATES))
    group, topic = TOPICS[topic_index]
    text = TEMPLATES[template].format(topic=topic) + STYLE_NOTES[style]
    return text, (f"prose/topics:{group}", f"prose/template:{template}")
