"""Built-in multi-turn chats for ``kvshuttle bench retokenize``, written for it (the shared traces hold only
block hashes, no text).

Each chat is (system or None, [(user, assistant), ...]): the assistant texts stand for what a model answered and
cover what tokenizers split unevenly: code with indentation and trailing blanks, JSON tool calls written as text,
numbers and dates, markdown tables, CJK, emoji, accents (one in decomposed form), and answers that start or end
with whitespace.
"""

# ruff: noqa: RUF001  (the chats are meant to hold look-alike characters: they are what tokenizers split)

from __future__ import annotations

Chat = tuple[str | None, list[tuple[str, str]]]

CHATS: list[Chat] = [
    ("You are a careful Python reviewer.", [
        ("Why does this loop never stop?\n\n```python\ni = 0\nwhile i < 10:\n    print(i)\n```",
         "The loop body never changes `i`, so `i < 10` stays true forever. Increment it:\n\n```python\n"
         "i = 0\nwhile i < 10:\n    print(i)\n    i += 1\n```\n\nOr, more idiomatically, `for i in range(10):`."),
        ("And if I want to skip odd numbers?",
         "Use a step of 2:\n\n```python\nfor i in range(0, 10, 2):\n    print(i)  # 0, 2, 4, 6, 8\n```\n\n"
         "`range(start, stop, step)` never includes `stop`.  "),
        ("Can you write it as a list comprehension that squares them?",
         "```python\nsquares = [i * i for i in range(0, 10, 2)]\nassert squares == [0, 4, 16, 36, 64]\n```"),
        ("Thanks!", "You're welcome. Happy hacking!"),
    ]),
    (None, [
        ("Plan a three-day trip to Kyoto in early April.",
         "Early April is cherry-blossom season (sakura), so book early.\n\n**Day 1** — Higashiyama: Kiyomizu-dera, "
         "Sannenzaka, Yasaka Shrine; evening walk in Gion.\n**Day 2** — Arashiyama: the bamboo grove, "
         "Tenryū-ji, a boat on the Hozu River.\n**Day 3** — Fushimi Inari at 7:00 before the crowds, then "
         "Nishiki Market (錦市場) for lunch.\n\nBudget roughly ¥15,000–¥25,000 per day excluding lodging."),
        ("What about rain?",
         "If it rains, swap Day 2 for museums: the Kyoto National Museum, the Railway Museum (京都鉄道博物館) "
         "and a tea ceremony in Uji. Umbrellas are ¥500 at any konbini ☔."),
        ("Give me the plan as a table.",
         "| Day | Morning | Afternoon | Evening |\n|---|---|---|---|\n| 1 | Kiyomizu-dera | Sannenzaka | Gion |\n"
         "| 2 | Bamboo grove | Tenryū-ji | Hozu River |\n| 3 | Fushimi Inari | Nishiki Market | — |\n"),
    ]),
    ("You can call tools. Reply with a JSON tool call when you need one.", [
        ("What's the weather in Zürich tomorrow?",
         '{"name": "get_weather", "arguments": {"city": "Zürich", "date": "2026-04-02", "unit": "celsius"}}'),
        ("Tool result: {\"high\": 14.5, \"low\": 3.2, \"rain_mm\": 0.8}",
         "Tomorrow in Zürich: a high of 14.5 °C, a low of 3.2 °C, and light rain (0.8 mm). Bring a jacket."),
        ("And Berlin?",
         '{"name":"get_weather","arguments":{"city":"Berlin","date":"2026-04-02","unit":"celsius"}}'),
        ("Tool result: {\"high\": 11, \"low\": -1, \"rain_mm\": 0}",
         "Berlin: 11 °C at most, −1 °C at night, dry. Colder than Zürich by 3.5 °C in the afternoon."),
    ]),
    (None, [
        ("Compute 17 * 23 and explain.",
         "17 × 23 = 391.\n\nBreak it up: 17 × 20 = 340 and 17 × 3 = 51; 340 + 51 = 391."),
        ("Now 1234567 / 89 to three decimals.",
         "1234567 ÷ 89 ≈ 13871.539\n\n(89 × 13871 = 1234519, remainder 48; 48 / 89 ≈ 0.53933.)"),
        ("Is 391 prime?", "No: 391 = 17 × 23, as we just saw."),
        ("List the primes below 30.", "2, 3, 5, 7, 11, 13, 17, 19, 23, 29 — ten of them."),
    ]),
    ("Réponds en français.", [
        ("Explique la différence entre « savoir » et « connaître ».",
         "« Savoir » s'emploie pour un fait ou une compétence : je sais nager, je sais qu'il pleut.\n"
         "« Connaître » s'emploie pour une personne, un lieu ou une œuvre : je connais Marie, je connais Paris."),
        ("Donne trois exemples avec des accents décomposés.",
         # "é" written as e + U+0301: a model may emit either form, NFC tokenizers normalise it
         "1. Il connai\u0302t le cafe\u0301 du coin.\n2. Je sais ou\u0300 il habite.\n3. Elle connai\u0302t "
         "l'e\u0301glise."),
        ("Merci 🙏", "\nAvec plaisir ! 😊\n"),
    ]),
    ("You write shell and SQL.", [
        ("Count lines in every .py file under src, largest first.",
         "```bash\nfind src -name '*.py' -print0 | xargs -0 wc -l | sort -rn | head -n 20\n```\n\n"
         "`-print0`/`-0` keep file names with spaces intact."),
        ("Same idea in SQL: top 5 customers by revenue in 2025.",
         "```sql\nSELECT c.id, c.name, SUM(o.total) AS revenue\nFROM customers AS c\nJOIN orders AS o ON o.customer_id"
         " = c.id\nWHERE o.created_at >= '2025-01-01' AND o.created_at < '2026-01-01'\nGROUP BY c.id, c.name\n"
         "ORDER BY revenue DESC\nLIMIT 5;\n```"),
        ("Add a rank column.",
         "```sql\nSELECT id, name, revenue,\n       RANK() OVER (ORDER BY revenue DESC) AS rnk\nFROM (\n    -- the"
         " query above, without LIMIT\n    SELECT c.id, c.name, SUM(o.total) AS revenue\n    FROM customers c\n"
         "    JOIN orders o ON o.customer_id = c.id\n    GROUP BY c.id, c.name\n) t\nORDER BY rnk\nLIMIT 5;\n```"),
    ]),
    (None, [
        ("用一句话解释什么是 KV 缓存。",
         "KV 缓存保存了模型在之前的 token 上计算出的键（K）和值（V），"
         "生成下一个 token 时直接复用，不必重新计算整个前缀。"),
        ("那多轮对话呢？",
         "多轮对话中，上一轮的提示和回答都已经算过一次；如果下一轮的提示以完全相同的 token 开头，这些块就可以复用。\n\n"
         "但如果回答被重新分词（re-tokenize）成不同的 token，那么从回答开始的块都无法复用。"),
        ("举个例子？",
         "比如模型生成了 “hel” + “lo” 两个 token，而分词器对文本 “hello” 只给出一个 token：文本相同，token 不同。"),
    ]),
    ("Be terse.", [
        ("yaml for a k8s deployment with 3 replicas of nginx:1.27",
         "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: nginx\nspec:\n  replicas: 3\n  selector:\n"
         "    matchLabels: {app: nginx}\n  template:\n    metadata:\n      labels: {app: nginx}\n    spec:\n"
         "      containers:\n        - name: nginx\n          image: nginx:1.27\n"
         "          ports: [{containerPort: 80}]\n"),
        ("add a readiness probe",
         "Under the container:\n\n    readinessProbe:\n      httpGet: {path: /, port: 80}\n      periodSeconds: 5\n"),
        ("and resource limits?",
         "    resources:\n      limits: {cpu: 500m, memory: 256Mi}\n      requests: {cpu: 100m, memory: 64Mi}"),
        ("ok", "Done."),
    ]),
]
