//! The demo's sample traffic: a deterministic mix of request kinds and
//! tenants, built from templates (no real personal data: the PII prompts use
//! reserved example domains, 555 phone numbers and test card numbers).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// What a request is, for the report ("where did the PII prompts go?").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A short prompt with personal data (email, phone, SSN, card).
    Pii,
    /// A question with pasted source code.
    Code,
    /// A short, simple question.
    Simple,
    /// A short but demanding question (design, trade-offs, proofs).
    Complex,
    /// A simple question about one of a few long shared documents.
    DocSimple,
    /// A demanding question about one of those documents.
    DocHard,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Pii,
        Kind::Code,
        Kind::Simple,
        Kind::Complex,
        Kind::DocSimple,
        Kind::DocHard,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Pii => "personal data",
            Kind::Code => "pasted code",
            Kind::Simple => "simple question",
            Kind::Complex => "hard question",
            Kind::DocSimple => "shared doc, simple",
            Kind::DocHard => "shared doc, hard",
        }
    }
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct DemoRequest {
    pub id: usize,
    pub kind: Kind,
    pub tenant: Option<&'static str>,
    pub body: Value,
}

/// The model every request asks for; rules may move it to another.
pub const REQUESTED_MODEL: &str = "qwen-2.5";

const TENANTS: &[(&str, u32)] = &[("acme", 45), ("globex", 35), ("trial", 15)];
/// Percent of requests without a tenant header.
const ANONYMOUS_PERCENT: u32 = 5;

const MIX: &[(Kind, u32)] = &[
    (Kind::Pii, 13),
    (Kind::Code, 12),
    (Kind::Simple, 20),
    (Kind::Complex, 15),
    (Kind::DocSimple, 25),
    (Kind::DocHard, 15),
];

const PRODUCTS: &[&str] = &[
    "Aurora kettle",
    "Borealis toaster",
    "Cirrus blender",
    "Drift coffee grinder",
];
const COLORS: &[&str] = &[
    "red", "green", "blue", "white", "black", "yellow", "grey", "orange",
];
const MATERIALS: &[&str] = &[
    "steel", "glass", "bamboo", "ceramic", "copper", "oak", "stone",
];
const PARTS: &[&str] = &[
    "lid", "base", "grip", "filter", "jug", "blade", "tray", "dial", "cord",
];
const FIRST: &[&str] = &[
    "Jane", "Omar", "Li", "Maria", "Tom", "Aiko", "Lars", "Nadia",
];
const LAST: &[&str] = &[
    "Doe", "Haddad", "Wei", "Rossi", "Berg", "Sato", "Novak", "Silva",
];
const COUNTRIES: &[&str] = &[
    "France", "Japan", "Chile", "Kenya", "Norway", "Canada", "Peru",
];
const LANGUAGES: &[&str] = &["Italian", "German", "Korean", "Swahili", "Dutch", "Polish"];
const TOPICS: &[&str] = &[
    "a rate limiter for a public API",
    "a job queue for video encoding",
    "a cache in front of a product catalogue",
    "a leaderboard for an online game",
    "a feature flag service",
];

/// The documents the shared-prefix requests ask about: a few hundred words
/// of plain product prose each (about 1,000 prompt tokens).
pub fn documents() -> Vec<String> {
    PRODUCTS
        .iter()
        .enumerate()
        .map(|(i, product)| document(i as u64, product))
        .collect()
}

fn document(seed: u64, product: &str) -> String {
    let mut rng = StdRng::seed_from_u64(0xd0c0 + seed);
    let mut out = format!("Owner manual: the {product}.\n\n");
    for section in 1..=8 {
        out.push_str(&format!("Section {section}.\n"));
        for _ in 0..7 {
            let color = pick(&mut rng, COLORS);
            let material = pick(&mut rng, MATERIALS);
            let part = pick(&mut rng, PARTS);
            let n = rng.random_range(12..240);
            let sentence = match rng.random_range(0..10) {
                0 => format!("The {product} comes in a {color} finish with a {material} {part}."),
                1 => format!("The {part} opens with a soft click and stays open at {n} degrees."),
                2 => format!(
                    "The cord is {n} centimetres long and folds into a slot under the base."
                ),
                3 => format!("A small light near the {part} turns {color} when the water is hot."),
                4 => format!(
                    "The box holds the {product}, a cleaning brush, a spare {part} and a warranty card."
                ),
                5 => format!("The {part} is made of {material} and can go in the dishwasher."),
                6 => format!("The {product} weighs {n} grams more than the model from last year."),
                7 => format!("A window on the side of the {part} shows the level of the water."),
                8 => format!(
                    "The warranty covers the {part} for {n} weeks from the date of purchase."
                ),
                _ => format!("A gentle tone sounds twice when the {part} is back in place."),
            };
            out.push_str(&sentence);
            out.push(' ');
        }
        out.push_str("\n\n");
    }
    out
}

fn pick<'a>(rng: &mut StdRng, from: &[&'a str]) -> &'a str {
    from[rng.random_range(0..from.len())]
}

fn weighted<T: Copy>(rng: &mut StdRng, items: &[(T, u32)]) -> T {
    let total: u32 = items.iter().map(|(_, w)| w).sum();
    let mut x = rng.random_range(0..total);
    for (item, w) in items {
        if x < *w {
            return *item;
        }
        x -= w;
    }
    items[items.len() - 1].0
}

/// `n` requests, the same for the same seed.
pub fn generate(n: usize, seed: u64) -> Vec<DemoRequest> {
    let docs = documents();
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|id| {
            // The first requests show every kind and tenant class once (so
            // even a tiny run reaches every rule), then the random mix.
            let mut kind = weighted(&mut rng, MIX);
            let mut tenant = if rng.random_range(0..100) < ANONYMOUS_PERCENT {
                None
            } else {
                Some(weighted(&mut rng, TENANTS))
            };
            if let Some(k) = Kind::ALL.get(id) {
                (kind, tenant) = (*k, Some("acme"));
            } else if id == Kind::ALL.len() {
                tenant = None;
            } else if id == Kind::ALL.len() + 1 {
                (kind, tenant) = (Kind::Simple, Some("trial"));
            }
            let (messages, max_tokens) = prompt(kind, &docs, &mut rng);
            let body = json!({
                "model": REQUESTED_MODEL,
                "messages": messages,
                "max_tokens": max_tokens,
                "stream": true,
            });
            DemoRequest {
                id,
                kind,
                tenant,
                body,
            }
        })
        .collect()
}

fn user(text: String) -> Value {
    json!([{ "role": "user", "content": text }])
}

fn prompt(kind: Kind, docs: &[String], rng: &mut StdRng) -> (Value, u32) {
    match kind {
        Kind::Pii => {
            let (first, last) = (pick(rng, FIRST), pick(rng, LAST));
            let text = match rng.random_range(0..3) {
                0 => format!(
                    "Please update the delivery address for {first} {last}: email {}.{}@example.com, phone +1 415 555 {:04}.",
                    first.to_lowercase(),
                    last.to_lowercase(),
                    rng.random_range(100..9999)
                ),
                1 => format!(
                    "Fill in the tax form for {first} {last}, SSN {:03}-{:02}-{:04}, born in {}.",
                    rng.random_range(101..665),
                    rng.random_range(10..99),
                    rng.random_range(1000..9999),
                    rng.random_range(1950..2004)
                ),
                _ => format!(
                    "Refund the last order of {first} {last}, paid with card 4111 1111 1111 1111, to the same card."
                ),
            };
            (user(text), 32)
        }
        Kind::Code => {
            let n = rng.random_range(2..9);
            let text = match rng.random_range(0..3) {
                0 => format!(
                    "Why does this crash on an empty list?\n\n```python\ndef mean(xs):\n    total = sum(xs)\n    return total / len(xs)\n\nprint(mean([{n}, {n}]))\nprint(mean([]))\n```"
                ),
                1 => format!(
                    "This loop never ends, what is wrong?\n\n```rust\nfn countdown(mut n: u32) {{\n    while n != 0 {{\n        n -= {n};\n    }}\n    println!(\"done\");\n}}\n```"
                ),
                _ => format!(
                    "What does this return for {n}?\n\n```javascript\nfunction f(n) {{\n  if (n < 2) return n;\n  return f(n - 1) + f(n - 2);\n}}\nconsole.log(f({n}));\n```"
                ),
            };
            (user(text), 48)
        }
        Kind::Simple => {
            let text = match rng.random_range(0..3) {
                0 => format!("What is the capital of {}?", pick(rng, COUNTRIES)),
                1 => format!("Translate good morning into {}.", pick(rng, LANGUAGES)),
                _ => format!("Name a fruit that is {}.", pick(rng, COLORS)),
            };
            (user(text), 16)
        }
        Kind::Complex => {
            let topic = pick(rng, TOPICS);
            let text = format!(
                "Design {topic} for a distributed system. Compare two approaches step by step, analyze the failure modes and justify the trade-offs you recommend."
            );
            (user(text), 64)
        }
        Kind::DocSimple | Kind::DocHard => {
            let i = rng.random_range(0..docs.len());
            let product = PRODUCTS[i];
            let question = if kind == Kind::DocSimple {
                match rng.random_range(0..3) {
                    0 => format!("What colour is the {} of the {product}?", pick(rng, PARTS)),
                    1 => format!("How long is the warranty on the {}?", pick(rng, PARTS)),
                    _ => format!("Can the {} go in the dishwasher?", pick(rng, PARTS)),
                }
            } else {
                format!(
                    "Using the manual above, compare the {} of the {product} with its {} step by step, analyze the trade-offs and justify which one to replace first.",
                    pick(rng, PARTS),
                    pick(rng, PARTS)
                )
            };
            let messages = json!([
                { "role": "system", "content": docs[i] },
                { "role": "user", "content": question },
            ]);
            (messages, if kind == Kind::DocSimple { 24 } else { 64 })
        }
    }
}

#[cfg(test)]
mod tests {
    use kinference_classifiers::{BuiltinKind, classify};

    use super::*;

    fn prompt_text(body: &Value) -> String {
        body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["content"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Each kind lands on the rule it is meant to show off.
    #[test]
    fn kinds_get_the_intended_tags() {
        let requests = generate(600, 7);
        for kind in Kind::ALL {
            assert!(requests.iter().any(|r| r.kind == kind), "{kind:?} missing");
        }
        for r in &requests {
            let text = prompt_text(&r.body);
            let pii = classify(BuiltinKind::Pii, &text);
            let code = classify(BuiltinKind::Code, &text);
            let complexity = classify(BuiltinKind::Complexity, &text);
            let has = |tags: &[String], t: &str| tags.iter().any(|x| x == t);
            let private = has(&pii, "pii-confirmed") || has(&pii, "pii-suspected");
            assert_eq!(private, r.kind == Kind::Pii, "{:?}: {pii:?}", r.kind);
            if r.kind == Kind::Pii {
                continue;
            }
            assert!(has(&pii, "pii-none"), "{:?}: {pii:?}", r.kind);
            let expected_code = if r.kind == Kind::Code {
                "code-confirmed"
            } else {
                "code-none"
            };
            assert!(has(&code, expected_code), "{:?}: {code:?}", r.kind);
            let expected = match r.kind {
                Kind::Simple => "complexity-low",
                Kind::DocSimple => "complexity-medium",
                Kind::Complex | Kind::DocHard => "complexity-high",
                Kind::Code | Kind::Pii => continue,
            };
            assert!(has(&complexity, expected), "{:?}: {complexity:?}", r.kind);
        }
    }

    #[test]
    fn deterministic_and_long_documents() {
        let a = generate(50, 1);
        let b = generate(50, 1);
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| x.body == y.body && x.tenant == y.tenant)
        );
        for doc in documents() {
            assert!(doc.len() > 3000, "{}", doc.len());
        }
    }
}
