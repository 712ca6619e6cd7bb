//! PII and secrets detection.
//!
//! Emits exactly one `pii-*` tag and one `ssn-*` tag. The split between
//! `confirmed` and `suspected` is what lets a policy be strict without being
//! noisy: `confirmed` is reserved for evidence that passed a check a random
//! string would fail (Luhn, mod-97, SSN numbering rules, the structure of an
//! email address, a vendor's key format), while `suspected` covers evidence that
//! is only suggestive (a 16-digit number failing Luhn, a street address, "my SSN
//! is" with no valid number, a random-looking token).
//!
//! Every detector looks at a small window around its match rather than at the
//! whole prompt, so a single keyword far away cannot turn an order number into
//! a card number, and the scan stays linear in the prompt length.

use std::ops::Range;
use std::sync::LazyLock;

use regex::Regex;

use crate::text::{
    after, before, char_classes, floor_boundary, next_char, prev_char, shannon_entropy,
};

/// Prompts larger than this are not scanned by [`classify_pii`]; they get
/// `pii-unknown` because a partial scan could not justify `pii-none`.
pub const DEFAULT_MAX_BYTES: usize = 1 << 20;

/// Every tag the PII classifier can emit.
pub const TAGS: &[&str] = &[
    "pii-confirmed",
    "pii-suspected",
    "pii-none",
    "pii-unknown",
    "ssn-confirmed",
    "ssn-suspected",
    "ssn-none",
    "ssn-unknown",
];

/// How sure the classifier is that the prompt carries the kind of data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    Confirmed,
    Suspected,
    None,
    /// The prompt could not be judged (empty, or over the size limit).
    Unknown,
}

impl Verdict {
    fn degree(self) -> &'static str {
        match self {
            Verdict::Confirmed => "confirmed",
            Verdict::Suspected => "suspected",
            Verdict::None => "none",
            Verdict::Unknown => "unknown",
        }
    }

    pub fn pii_tag(self) -> &'static str {
        match self {
            Verdict::Confirmed => "pii-confirmed",
            Verdict::Suspected => "pii-suspected",
            Verdict::None => "pii-none",
            Verdict::Unknown => "pii-unknown",
        }
    }

    pub fn ssn_tag(self) -> &'static str {
        match self {
            Verdict::Confirmed => "ssn-confirmed",
            Verdict::Suspected => "ssn-suspected",
            Verdict::None => "ssn-none",
            Verdict::Unknown => "ssn-unknown",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.degree())
    }
}

/// Strength of a single piece of evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Strength {
    Suspected,
    Confirmed,
}

/// What a finding looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PiiKind {
    Email,
    Phone,
    Ssn,
    PaymentCard,
    Iban,
    /// A token in a vendor's documented key format (`sk-`, `AKIA`, `ghp_`, ...).
    ApiKey,
    PrivateKey,
    /// A literal credential: `password=...`, `user:pass@host`, `Bearer ...`.
    Credential,
    HighEntropyToken,
    Address,
    DateOfBirth,
    /// A phrase announcing personal data ("my passport number is").
    Disclosure,
}

/// One piece of evidence, with the byte range it covers in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub kind: PiiKind,
    pub strength: Strength,
    pub span: Range<usize>,
}

/// The full result of a PII scan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PiiReport {
    pub pii: Verdict,
    pub ssn: Verdict,
    /// Evidence behind the verdicts, not an inventory: scanning for more stops
    /// once the verdicts cannot get stronger (for the `pii-*` tag, at the first
    /// confirmed finding), and the list is capped at [`MAX_FINDINGS`] entries,
    /// so a prompt full of PII stays cheap to scan and the report small.
    pub findings: Vec<Finding>,
}

/// Upper bound on [`PiiReport::findings`].
pub const MAX_FINDINGS: usize = 64;

impl PiiReport {
    fn unknown() -> Self {
        PiiReport {
            pii: Verdict::Unknown,
            ssn: Verdict::Unknown,
            findings: Vec::new(),
        }
    }

    /// The `pii-*` tag followed by the `ssn-*` tag.
    pub fn tags(&self) -> Vec<String> {
        vec![self.pii.pii_tag().to_owned(), self.ssn.ssn_tag().to_owned()]
    }
}

/// Classifies with the default size limit.
pub fn classify_pii(prompt: &str) -> Vec<String> {
    classify_pii_with_limit(prompt, DEFAULT_MAX_BYTES)
}

/// Classifies, answering `pii-unknown`/`ssn-unknown` for prompts longer than
/// `max_bytes` bytes or blank ones.
pub fn classify_pii_with_limit(prompt: &str, max_bytes: usize) -> Vec<String> {
    analyze(prompt, max_bytes).tags()
}

/// Scans the prompt and returns the verdicts with their evidence.
///
/// Linear in the prompt length. Detectors that need a long number only look
/// at the numbers, and keyword-driven detectors only at windows around their
/// keywords, so a long prompt costs a handful of passes, not one per pattern.
pub fn analyze(prompt: &str, max_bytes: usize) -> PiiReport {
    if prompt.len() > max_bytes || prompt.trim().is_empty() {
        return PiiReport::unknown();
    }
    let mut scan = Scan::new(prompt);
    scan.emails();
    scan.keyword_windows();
    scan.numbers();
    scan.ibans();
    scan.secrets();
    scan.street_addresses();
    scan.high_entropy_tokens();
    scan.finish()
}

struct Scan<'a> {
    text: &'a str,
    /// End offsets of phone keywords ("call", "tel", ...), ascending; filled by
    /// [`Scan::keyword_windows`] so that [`Scan::numbers`] can skip the
    /// keyword-phone patterns for numbers with no such word nearby.
    phone_words: Vec<usize>,
    /// Start offsets of SSN keywords, likewise for the SSN detectors.
    ssn_words: Vec<usize>,
    findings: Vec<Finding>,
    pii: Option<Strength>,
    ssn: Option<Strength>,
}

fn shift(r: Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

impl<'a> Scan<'a> {
    fn new(text: &'a str) -> Self {
        Scan {
            text,
            phone_words: Vec::new(),
            ssn_words: Vec::new(),
            findings: Vec::new(),
            pii: None,
            ssn: None,
        }
    }

    fn add(&mut self, kind: PiiKind, strength: Strength, span: Range<usize>) {
        self.pii = self.pii.max(Some(strength));
        if kind == PiiKind::Ssn {
            self.ssn = self.ssn.max(Some(strength));
        }
        if self.findings.len() < MAX_FINDINGS {
            self.findings.push(Finding {
                kind,
                strength,
                span,
            });
        }
    }

    /// No further evidence can change the `pii-*` tag, only the `ssn-*` one.
    fn pii_settled(&self) -> bool {
        self.pii == Some(Strength::Confirmed)
    }

    /// No further evidence can change either tag.
    fn settled(&self) -> bool {
        self.pii_settled() && self.ssn == Some(Strength::Confirmed)
    }

    fn finish(self) -> PiiReport {
        let verdict = |s: Option<Strength>| match s {
            Some(Strength::Confirmed) => Verdict::Confirmed,
            Some(Strength::Suspected) => Verdict::Suspected,
            None => Verdict::None,
        };
        PiiReport {
            pii: verdict(self.pii),
            ssn: verdict(self.ssn),
            findings: self.findings,
        }
    }

    fn context_before(&self, re: &Regex, pos: usize, n: usize) -> bool {
        re.is_match(before(self.text, pos, n))
    }

    fn emails(&mut self) {
        let text = self.text;
        for m in EMAIL.find_iter(text) {
            if self.pii_settled() {
                return;
            }
            if !is_placeholder_email(m.as_str()) && next_char(text, m.end()) != Some('@') {
                self.add(PiiKind::Email, Strength::Confirmed, m.range());
            }
        }
    }

    fn numbers(&mut self) {
        for (span, digits) in number_spans(self.text) {
            if self.settled() {
                return;
            }
            if !self.pii_settled() {
                self.phones_in(span.clone(), digits);
            }
            if digits >= 9 {
                self.ssns_in(span.clone());
            }
            if digits >= 13 && !self.pii_settled() {
                self.cards_in(span);
            }
        }
    }

    fn phone_word_before(&self, pos: usize, n: usize) -> bool {
        near_before(&self.phone_words, pos, n)
    }

    fn phones_in(&mut self, span: Range<usize>, digits: usize) {
        let text = self.text;
        let slice = &text[span.clone()];
        if slice.contains('+') {
            for m in PHONE_INTL.find_iter(slice) {
                let r = shift(m.range(), span.start);
                if (8..=15).contains(&count_digits(m.as_str())) && number_bounded(text, r.clone()) {
                    self.add(PiiKind::Phone, Strength::Confirmed, r);
                }
            }
        }
        for caps in PHONE_US.captures_iter(slice).filter(|_| digits >= 10) {
            let whole = shift(
                caps.get(0).expect("group 0 always matches").range(),
                span.start,
            );
            if !number_bounded(text, whole.clone()) {
                continue;
            }
            let parenthesised = caps.get(1).is_some();
            // Mixed separators ("555-123.4567") are more often codes than phones.
            if let (Some(a), Some(b)) = (caps.get(3), caps.get(4))
                && a.as_str() != b.as_str()
            {
                continue;
            }
            let strength = if parenthesised || self.context_before(&PHONE_CONTEXT, whole.start, 48)
            {
                Strength::Confirmed
            } else if self.context_before(&CODE_CONTEXT, whole.start, 32) {
                continue;
            } else {
                Strength::Suspected
            };
            self.add(PiiKind::Phone, strength, whole);
        }
        // National formats are only recognisable by the words before them.
        if !self.phone_word_before(span.start, 64) {
            return;
        }
        let window = before(text, span.end, span.len() + 64);
        let window_start = span.end - window.len();
        for re in [&*PHONE_AFTER_KEYWORD, &*PHONE_VERB_AT] {
            for caps in re.captures_iter(window) {
                let number = caps.get(1).expect("group 1 always matches");
                let r = shift(number.range(), window_start);
                if r.start >= span.start
                    && (7..=15).contains(&count_digits(number.as_str()))
                    && number_bounded(text, r.clone())
                    && !looks_like_date_or_version(number.as_str())
                {
                    self.add(PiiKind::Phone, Strength::Confirmed, r);
                }
            }
        }
    }

    fn ssn_word_before(&self, pos: usize, n: usize) -> bool {
        near_before(&self.ssn_words, pos, n)
    }

    /// The SSN keyword regex runs only where the cheap keyword index says a
    /// keyword may be.
    fn ssn_context(&self, pos: usize, n: usize) -> bool {
        self.ssn_word_before(pos, n) && self.context_before(&SSN_CONTEXT, pos, n)
    }

    fn ssns_in(&mut self, span: Range<usize>) {
        let text = self.text;
        let b = text.as_bytes();
        let mut p = span.start;
        while p < span.end {
            let run_start = p == span.start || !b[p - 1].is_ascii_digit();
            if !b[p].is_ascii_digit() || !run_start {
                p += 1;
                continue;
            }
            let run_end = p + b[p..span.end]
                .iter()
                .take_while(|c| c.is_ascii_digit())
                .count();
            if run_end - p == 9 {
                self.plain_ssn(p..run_end);
            } else if let Some(sep) = delimited_ssn_at(b, p, span.end) {
                self.delimited_ssn(p..p + 11, sep);
            }
            p = run_end;
        }
    }

    /// `AAA-GG-SSSS`, or `AAA GG SSSS` next to the word SSN.
    fn delimited_ssn(&mut self, r: Range<usize>, sep: u8) {
        if !number_bounded(self.text, r.clone()) {
            return;
        }
        let ssn_ctx = self.ssn_context(r.start, 48);
        // Space-separated triples are too common in tables and lists to count
        // without the word "SSN" nearby.
        if sep == b' ' && !ssn_ctx {
            return;
        }
        if !ssn_ctx && self.context_before(&CODE_CONTEXT, r.start, 32) {
            return;
        }
        let valid = parse_ssn(&self.text[r.clone()]).is_some_and(|(a, g, s)| ssn_valid(a, g, s));
        if valid {
            self.add(PiiKind::Ssn, Strength::Confirmed, r);
        } else if ssn_ctx {
            self.add(PiiKind::Ssn, Strength::Suspected, r);
        }
    }

    /// Nine bare digits are an SSN only right after the word SSN.
    fn plain_ssn(&mut self, r: Range<usize>) {
        if !number_bounded(self.text, r.clone()) || !self.ssn_context(r.start, 32) {
            return;
        }
        let valid = parse_ssn(&self.text[r.clone()]).is_some_and(|(a, g, s)| ssn_valid(a, g, s));
        let strength = if valid {
            Strength::Confirmed
        } else {
            Strength::Suspected
        };
        self.add(PiiKind::Ssn, strength, r);
    }

    fn cards_in(&mut self, span: Range<usize>) {
        for run in digit_runs(self.text, span) {
            self.card_candidate(&run);
        }
    }

    fn card_candidate(&mut self, run: &DigitRun) {
        // Longer runs are not split into a card plus "something else": lists
        // of 4-digit numbers would then produce cards by chance.
        if !(13..=19).contains(&run.digits.len()) {
            return;
        }
        let grouped = run.groups.len() > 1;
        if grouped && !card_grouping(&run.groups) {
            return;
        }
        let span = run.span.clone();
        let card_ctx = self.context_before(&CARD_CONTEXT, span.start, 64)
            || CARD_CONTEXT.is_match(after(self.text, span.end, 64));
        let brand = card_brand(&run.digits).is_some();
        let strength = if brand && luhn_valid(&run.digits) {
            // An unformatted number right after "order"/"invoice" is an id that
            // happens to pass Luhn (one in ten numbers does).
            if grouped || card_ctx || !self.context_before(&CODE_CONTEXT, span.start, 32) {
                Strength::Confirmed
            } else {
                return;
            }
        } else if card_ctx || (grouped && brand && run.digits.len() == 16) {
            Strength::Suspected
        } else {
            return;
        };
        self.add(PiiKind::PaymentCard, strength, span);
    }

    fn ibans(&mut self) {
        let b = self.text.as_bytes();
        // A byte loop finds "CC99" starts far faster than a regex with no
        // literal to anchor on; the regex then only runs on those spots.
        // Candidates are at least 12 bytes of [A-Z0-9 ], so byte i+11 decides
        // whether any can start in i..i+12.
        let iban_byte = |c: u8| c.is_ascii_uppercase() || c.is_ascii_digit() || c == b' ';
        let mut i = 0;
        while i + 3 < b.len() {
            if b.get(i + 11).is_some_and(|&c| !iban_byte(c)) {
                i += 12;
                continue;
            }
            let head = b[i].is_ascii_uppercase()
                && b[i + 1].is_ascii_uppercase()
                && b[i + 2].is_ascii_digit()
                && b[i + 3].is_ascii_digit()
                && (i == 0 || !b[i - 1].is_ascii_alphanumeric());
            if head {
                if self.pii_settled() {
                    return;
                }
                self.iban_at(i);
            }
            i += 1;
        }
    }

    fn iban_at(&mut self, start: usize) {
        let text = self.text;
        if iban_length(&text[start..start + 2]).is_none() {
            return;
        }
        let end = floor_boundary(text, start + 48);
        let Some(m) = IBAN_CANDIDATE
            .find(&text[start..end])
            .filter(|m| m.start() == 0)
        else {
            return;
        };
        let r = shift(m.range(), start);
        let compact: String = m.as_str().chars().filter(|c| *c != ' ').collect();
        let len = iban_length(&compact[..2]).unwrap_or(usize::MAX);
        if compact.len() < len {
            return;
        }
        if iban_valid(&compact[..len]) {
            self.add(PiiKind::Iban, Strength::Confirmed, r);
        } else if self.context_before(&IBAN_CONTEXT, r.start, 32) {
            self.add(PiiKind::Iban, Strength::Suspected, r);
        }
    }

    fn secrets(&mut self) {
        if self.pii_settled() {
            return;
        }
        let text = self.text;
        for m in KEY_FORMAT.find_iter(text) {
            if !is_placeholder_secret(m.as_str()) {
                self.add(PiiKind::ApiKey, Strength::Confirmed, m.range());
            }
        }
        for m in PEM_PRIVATE_KEY.find_iter(text) {
            self.add(PiiKind::PrivateKey, Strength::Confirmed, m.range());
        }
        for caps in URL_CREDENTIALS.captures_iter(text) {
            let password = caps.get(1).expect("password group");
            if !is_placeholder_secret(password.as_str()) {
                self.add(PiiKind::Credential, Strength::Confirmed, password.range());
            }
        }
        for caps in BEARER.captures_iter(text) {
            let token = caps.get(1).expect("token group");
            if looks_random(token.as_str()) {
                self.add(PiiKind::Credential, Strength::Confirmed, token.range());
            }
        }
    }

    /// Finds the keywords that several detectors hinge on in one pass over a
    /// lower-cased copy, then runs each detector only around its keywords.
    fn keyword_windows(&mut self) {
        let text = self.text;
        let lower = text.to_ascii_lowercase();
        let lb = lower.as_bytes();
        let mut windows: [Vec<Range<usize>>; Anchor::COUNT] = Default::default();
        let mut assignments = Vec::new();
        for m in ANCHORS.find_iter(&lower) {
            let Some(anchor) = Anchor::of(m.as_str()) else {
                continue;
            };
            // Key names end in the keyword (DB_PASSWORD, api_key), so those
            // are parsed from the keyword outwards; the others start a word.
            if anchor == Anchor::Assignment {
                if !self.pii_settled()
                    && let Some(found) = assignment_at(lb, m.range())
                {
                    assignments.push(found);
                }
                continue;
            }
            if m.start() > 0 && lb[m.start() - 1].is_ascii_alphanumeric() {
                continue;
            }
            match anchor {
                Anchor::Phone => {
                    self.phone_words.push(m.end());
                    continue;
                }
                Anchor::Ssn => self.ssn_words.push(m.start()),
                _ => {}
            }
            // "date of birth" is both a date-of-birth cue and a disclosure.
            let families: &[Anchor] = match anchor {
                Anchor::Birth => &[Anchor::Birth, Anchor::Disclosure],
                _ => std::slice::from_ref(&anchor),
            };
            for &family in families {
                let (back, ahead) = family.window();
                let start = word_boundary_before(text, m.start().saturating_sub(back));
                let end = floor_boundary(text, m.end() + ahead);
                let list = &mut windows[family as usize];
                match list.last_mut() {
                    Some(last) if last.end >= start => {
                        *last = last.start.min(start)..last.end.max(end);
                    }
                    _ => list.push(start..end),
                }
            }
        }
        for w in std::mem::take(&mut windows[Anchor::Ssn as usize]) {
            for m in SSN_DISCLOSURE.find_iter(&text[w.clone()]) {
                self.add(PiiKind::Ssn, Strength::Suspected, shift(m.range(), w.start));
            }
        }
        if self.pii_settled() {
            return;
        }
        for w in std::mem::take(&mut windows[Anchor::Disclosure as usize]) {
            for m in DISCLOSURE.find_iter(&text[w.clone()]) {
                self.add(
                    PiiKind::Disclosure,
                    Strength::Suspected,
                    shift(m.range(), w.start),
                );
            }
        }
        for w in std::mem::take(&mut windows[Anchor::Birth as usize]) {
            for m in DATE_OF_BIRTH.find_iter(&text[w.clone()]) {
                self.add(
                    PiiKind::DateOfBirth,
                    Strength::Suspected,
                    shift(m.range(), w.start),
                );
            }
        }
        for (key, quoted, value) in assignments {
            if self.pii_settled() {
                return;
            }
            if let Some(strength) = judge_assigned_secret(&text[key], &text[value.clone()], quoted)
            {
                self.add(PiiKind::Credential, strength, value);
            }
        }
    }

    /// Addresses start with a house number followed by a capitalised word;
    /// only those spots are handed to the address pattern.
    fn street_addresses(&mut self) {
        let text = self.text;
        let b = text.as_bytes();
        let mut i = 0;
        while i < b.len() {
            // Skip digit-free 32-byte chunks with a branch-free test that
            // vectorises; prose has few digits.
            if b.len() - i >= 32
                && !b[i..i + 32]
                    .iter()
                    .fold(false, |acc, c| acc | c.is_ascii_digit())
            {
                i += 32;
                continue;
            }
            if !b[i].is_ascii_digit() {
                i += 1;
                continue;
            }
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let mut j = i;
            if j < b.len() && b[j].is_ascii_alphabetic() {
                j += 1;
            }
            let house_number = i - start <= 5
                && (start == 0 || !b[start - 1].is_ascii_alphanumeric())
                && b.get(j) == Some(&b' ')
                && b.get(j + 1).is_some_and(u8::is_ascii_uppercase);
            if !house_number {
                continue;
            }
            if self.pii_settled() {
                return;
            }
            let end = floor_boundary(text, start + 96);
            if let Some(m) = STREET_ADDRESS
                .find(&text[start..end])
                .filter(|m| m.start() == 0)
            {
                self.add(
                    PiiKind::Address,
                    Strength::Suspected,
                    shift(m.range(), start),
                );
            }
        }
    }

    fn high_entropy_tokens(&mut self) {
        let text = self.text;
        let b = text.as_bytes();
        let token_byte =
            |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'_' | b'-');
        let mut i = 0;
        // Tokens are at least 24 bytes, so any that starts in i..i+24 covers
        // the probe at i+23: look there first and measure only its run.
        while i + 23 < b.len() {
            let probe = i + 23;
            if !token_byte(b[probe]) {
                i = probe + 1;
                continue;
            }
            let mut start = probe;
            while start > i && token_byte(b[start - 1]) {
                start -= 1;
            }
            let mut run_end = probe + 1;
            while run_end < b.len() && token_byte(b[run_end]) {
                run_end += 1;
            }
            i = run_end;
            if run_end - start < 24 {
                continue;
            }
            if self.pii_settled() {
                return;
            }
            let mut end = run_end;
            while end < b.len() && end - run_end < 2 && b[end] == b'=' {
                end += 1;
            }
            let token = &text[start..end];
            if token.len() > 200 || !looks_random(token) || self.inside_url_or_digest(start..end) {
                continue;
            }
            let strength = if self.context_before(&SECRET_CONTEXT, start, 40) {
                Strength::Confirmed
            } else {
                Strength::Suspected
            };
            self.add(PiiKind::HighEntropyToken, strength, start..end);
        }
    }

    /// URLs (video ids, document ids) and integrity digests are random-looking
    /// but public by design.
    fn inside_url_or_digest(&self, span: Range<usize>) -> bool {
        let prefix = before(self.text, span.start, 256);
        let word = match prefix.char_indices().rev().find(|(_, c)| c.is_whitespace()) {
            Some((i, c)) => &prefix[i + c.len_utf8()..],
            None => prefix,
        };
        let lower = word.to_ascii_lowercase();
        lower.contains("://")
            || lower.starts_with("www.")
            || lower.ends_with("base64,")
            || lower.ends_with("sha256:")
            || lower.ends_with("sha512:")
            || DIGEST_PREFIX.is_match(&self.text[span])
    }
}

/// Keyword families that gate the window-based detectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Anchor {
    Ssn,
    Disclosure,
    Birth,
    Assignment,
    Phone,
}

impl Anchor {
    const COUNT: usize = 5;

    fn of(keyword: &str) -> Option<Anchor> {
        Some(match keyword {
            "ssn" | "social" | "soc" | "ss#" => Anchor::Ssn,
            "dob" | "birth" | "born" | "d.o.b" => Anchor::Birth,
            "passport" | "licen" | "account" | "routing" | "card" | "address" | "tax id"
            | "medical record" | "mrn" | "insurance" | "pin" => Anchor::Disclosure,
            "pass" | "pwd" | "secret" | "key" | "token" => Anchor::Assignment,
            "phone" | "tel" | "mobile" | "cell" | "fax" | "whatsapp" | "call" | "dial" | "text"
            | "ring" | "reach" | "contact" | "sms" | "my number" => Anchor::Phone,
            _ => return None,
        })
    }

    /// Bytes to look at before and after the keyword.
    fn window(self) -> (usize, usize) {
        match self {
            Anchor::Ssn => (48, 64),
            Anchor::Disclosure => (48, 48),
            Anchor::Birth => (48, 64),
            Anchor::Assignment | Anchor::Phone => (0, 0),
        }
    }
}

/// A `key = value` assignment around a key-name keyword at `kw` in the
/// lower-cased prompt: the key is the identifier holding the keyword and must
/// end in a secret's name, so `max_tokens: 5` or `tokenizer = ...` do not
/// count. Returns the key, whether the value is quoted, and the value.
fn assignment_at(lb: &[u8], kw: Range<usize>) -> Option<(Range<usize>, bool, Range<usize>)> {
    let ident = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-');
    let mut key_start = kw.start;
    let floor = kw.start.saturating_sub(64);
    while key_start > floor && ident(lb[key_start - 1]) {
        key_start -= 1;
    }
    let mut key_end = kw.end;
    let ceil = kw.end + 24;
    while key_end < lb.len()
        && key_end < ceil
        && (lb[key_end].is_ascii_alphanumeric() || matches!(lb[key_end], b'_' | b'-'))
    {
        key_end += 1;
    }
    if !key_names_secret(&lb[key_start..key_end]) {
        return None;
    }
    let blanks = |mut i: usize| {
        while matches!(lb.get(i), Some(b' ' | b'\t')) {
            i += 1;
        }
        i
    };
    let mut i = key_end;
    if matches!(lb.get(i), Some(b'"' | b'\'')) {
        i += 1;
    }
    i = blanks(i);
    match lb.get(i) {
        Some(b':') if lb.get(i + 1) == Some(&b'=') => i += 2,
        Some(b':' | b'=') => i += 1,
        _ => return None,
    }
    i = blanks(i);
    let quoted = matches!(lb.get(i), Some(b'"' | b'\'' | b'`'));
    if quoted {
        i += 1;
    }
    let start = i;
    // Credentials are short; a longer value is data, and bounding it keeps
    // a run of back-to-back assignments linear.
    let limit = (start + MAX_SECRET_LEN).min(lb.len());
    while i < limit
        && !lb[i].is_ascii_whitespace()
        && !matches!(lb[i], b'"' | b'\'' | b'`' | b',' | b';')
    {
        i += 1;
    }
    let cut_short = i == start + MAX_SECRET_LEN;
    (i > start && !cut_short).then_some((key_start..key_end, quoted, start..i))
}

const MAX_SECRET_LEN: usize = 256;

/// Key names that hold credentials (`DB_PASSWORD`, `api_key`, `auth_token`).
fn key_names_secret(key: &[u8]) -> bool {
    const SUFFIXES: &[&[u8]] = &[
        b"password",
        b"passwd",
        b"passphrase",
        b"pwd",
        b"secret",
        b"apikey",
        b"api_key",
        b"api-key",
        b"access_key",
        b"access-key",
        b"secret_key",
        b"secret-key",
        b"private_key",
        b"private-key",
        b"token",
        b"_pass",
        b".pass",
        b"-pass",
    ];
    key == b"pass" || SUFFIXES.iter().any(|s| key.ends_with(s))
}

/// `AAA-GG-SSSS` or `AAA GG SSSS` (one separator, used twice) at `p`, within
/// `end`; returns the separator.
fn delimited_ssn_at(b: &[u8], p: usize, end: usize) -> Option<u8> {
    if p + 11 > end {
        return None;
    }
    let digits = |r: Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    let sep = b[p + 3];
    (matches!(sep, b'-' | b' ')
        && b[p + 6] == sep
        && digits(p..p + 3)
        && digits(p + 4..p + 6)
        && digits(p + 7..p + 11))
    .then_some(sep)
}

/// Whether a sorted list of keyword offsets has one in `pos - n ..= pos`.
fn near_before(offsets: &[usize], pos: usize, n: usize) -> bool {
    let first = offsets.partition_point(|&o| o < pos.saturating_sub(n));
    offsets.get(first).is_some_and(|&o| o <= pos)
}

/// Moves a window start back to the beginning of the word it falls in, so a
/// detector never sees half a word as a whole one.
fn word_boundary_before(text: &str, pos: usize) -> usize {
    let mut pos = floor_boundary(text, pos);
    let b = text.as_bytes();
    let floor = pos.saturating_sub(64);
    while pos > floor && (b[pos - 1].is_ascii_alphanumeric() || b[pos - 1] == b'_') {
        pos -= 1;
    }
    pos
}

/// Spans of digits joined by short separator runs (`+`, `(`, `)`, space,
/// dot, dash) holding at least 7 digits, with their digit counts: every
/// number-based detector needs that many, and most numbers in prose (years,
/// counts, versions) have fewer.
fn number_spans(text: &str) -> Vec<(Range<usize>, usize)> {
    let b = text.as_bytes();
    let span_byte =
        |c: u8| c.is_ascii_digit() || matches!(c, b' ' | b'.' | b'-' | b'(' | b')' | b'+');
    let mut spans = Vec::new();
    let mut i = 0;
    // A qualifying span is at least 7 bytes of `span_byte`, so it covers the
    // probe at i+6 whatever its start in i..i+7: look at the probe first and
    // only parse the run of span bytes around it, if it is long enough.
    while i + 6 < b.len() {
        let probe = i + 6;
        if !span_byte(b[probe]) {
            i = probe + 1;
            continue;
        }
        let mut start = probe;
        while start > i && span_byte(b[start - 1]) {
            start -= 1;
        }
        let mut end = probe + 1;
        while end < b.len() && span_byte(b[end]) {
            end += 1;
        }
        if end - start >= 7 {
            parse_number_spans(b, start..end, &mut spans);
        }
        i = end;
    }
    spans
}

/// The spans inside one run of span bytes.
fn parse_number_spans(b: &[u8], run: Range<usize>, spans: &mut Vec<(Range<usize>, usize)>) {
    let mut i = run.start;
    while i < run.end {
        let opener = matches!(b[i], b'+' | b'(') && i + 1 < run.end && b[i + 1].is_ascii_digit();
        if !(b[i].is_ascii_digit() || opener) {
            i += 1;
            continue;
        }
        let start = i;
        if opener {
            i += 1;
        }
        let mut digits = 0;
        let end = loop {
            while i < run.end && b[i].is_ascii_digit() {
                digits += 1;
                i += 1;
            }
            let mut j = i;
            while j < run.end && j - i < 2 && !b[j].is_ascii_digit() && b[j] != b'+' {
                j += 1;
            }
            if j > i && j < run.end && b[j].is_ascii_digit() {
                i = j;
            } else {
                break i;
            }
        };
        if digits >= 7 {
            spans.push((start..end, digits));
        }
        i = end.max(start + 1);
    }
}

fn count_digits(s: &str) -> usize {
    s.bytes().filter(u8::is_ascii_digit).count()
}

/// A number must stand alone: not glued to letters, and not one piece of a
/// longer dotted/dashed token such as a version, an IP address or a part code.
fn number_bounded(text: &str, span: Range<usize>) -> bool {
    let glued = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    match prev_char(text, span.start) {
        Some(c) if c.is_ascii_alphanumeric() || c == '_' => return false,
        Some('.' | '-' | '/' | '+') if glued(prev_char(text, span.start - 1)) => return false,
        _ => {}
    }
    match next_char(text, span.end) {
        Some(c) if c.is_ascii_alphanumeric() || c == '_' => false,
        Some('.' | '-' | '/') if glued(next_char(text, span.end + 1)) => false,
        _ => true,
    }
}

fn looks_like_date_or_version(s: &str) -> bool {
    DATE_OR_VERSION.is_match(s.trim())
}

/// Splits an SSN written as `AAA-GG-SSSS`, `AAA GG SSSS` or `AAAGGSSSS`.
pub fn parse_ssn(s: &str) -> Option<(u16, u8, u16)> {
    let digits: String = s.chars().filter(|c| c.is_ascii_digit()).collect();
    if digits.len() != 9
        || s.chars()
            .any(|c| !(c.is_ascii_digit() || c == '-' || c == ' '))
    {
        return None;
    }
    let area = digits[0..3].parse().ok()?;
    let group = digits[3..5].parse().ok()?;
    let serial = digits[5..9].parse().ok()?;
    Some((area, group, serial))
}

/// The SSA's numbering rules: area 001-899 except 666, group 01-99, serial
/// 0001-9999. A few numbers that satisfy the rules were published in
/// advertising and are known never to identify a person.
pub fn ssn_valid(area: u16, group: u8, serial: u16) -> bool {
    const PUBLISHED: [(u16, u8, u16); 3] = [(78, 5, 1120), (219, 9, 9999), (457, 55, 5462)];
    (1..900).contains(&area)
        && area != 666
        && (1..=99).contains(&group)
        && (1..=9999).contains(&serial)
        && !PUBLISHED.contains(&(area, group, serial))
}

/// Luhn checksum over a string of ASCII digits; false for anything else.
pub fn luhn_valid(digits: &str) -> bool {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    let sum: u32 = digits
        .bytes()
        .rev()
        .enumerate()
        .map(|(i, b)| {
            let d = u32::from(b - b'0');
            if i % 2 == 1 {
                let doubled = d * 2;
                if doubled > 9 { doubled - 9 } else { doubled }
            } else {
                d
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

/// Payment card networks, recognised by their issuer prefix and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CardBrand {
    Visa,
    Mastercard,
    Amex,
    Discover,
    Jcb,
    Diners,
    UnionPay,
    Maestro,
    Mir,
}

/// The network whose prefix and length rules `digits` satisfies. Checking the
/// prefix as well as Luhn removes most long numbers that pass Luhn by chance.
pub fn card_brand(digits: &str) -> Option<CardBrand> {
    if !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() < 4 {
        return None;
    }
    let len = digits.len();
    let p = |n: usize| digits[..n].parse::<u32>().unwrap_or(0);
    let (p1, p2, p3, p4) = (p(1), p(2), p(3), p(4));
    let brand = if p1 == 4 && matches!(len, 13 | 16 | 19) {
        CardBrand::Visa
    } else if ((51..=55).contains(&p2) || (2221..=2720).contains(&p4)) && len == 16 {
        CardBrand::Mastercard
    } else if (p2 == 34 || p2 == 37) && len == 15 {
        CardBrand::Amex
    } else if (p4 == 6011 || p2 == 65 || (644..=649).contains(&p3)) && (16..=19).contains(&len) {
        CardBrand::Discover
    } else if (3528..=3589).contains(&p4) && (16..=19).contains(&len) {
        CardBrand::Jcb
    } else if ((300..=305).contains(&p3) || p2 == 36 || p2 == 38 || p2 == 39)
        && (14..=19).contains(&len)
    {
        CardBrand::Diners
    } else if p2 == 62 && (16..=19).contains(&len) {
        CardBrand::UnionPay
    } else if (2200..=2204).contains(&p4) && len == 16 {
        CardBrand::Mir
    } else if (p2 == 50 || (56..=58).contains(&p2) || p2 == 67 || p2 == 63)
        && (13..=19).contains(&len)
    {
        CardBrand::Maestro
    } else {
        return None;
    };
    Some(brand)
}

/// Group lengths printed on cards: 4-4-4-4(-3), Amex 4-6-5, Diners 4-6-4.
fn card_grouping(groups: &[usize]) -> bool {
    matches!(groups, [4, 6, 5] | [4, 6, 4])
        || (groups.len() >= 3
            && groups[..groups.len() - 1].iter().all(|&g| g == 4)
            && (1..=4).contains(groups.last().expect("non-empty")))
}

struct DigitRun {
    digits: String,
    span: Range<usize>,
    /// Length of each group of digits.
    groups: Vec<usize>,
}

/// Maximal runs of digit groups joined by one consistent separator (space or
/// dash), e.g. `4111 1111 1111 1111`, inside `span`. Hand-written because the
/// grouping, not just the digits, decides whether a number looks like a card.
fn digit_runs(text: &str, span: Range<usize>) -> Vec<DigitRun> {
    let bytes = text.as_bytes();
    let end = span.end.min(bytes.len());
    let mut runs = Vec::new();
    let mut i = span.start;
    while i < end {
        if !bytes[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        let mut sep: Option<u8> = None;
        let mut groups = Vec::new();
        let mut digits = String::new();
        loop {
            let group_start = i;
            while i < end && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if digits.len() <= 40 {
                digits.push_str(&text[group_start..i]);
            }
            groups.push(i - group_start);
            let next_is_group = i + 1 < end
                && (bytes[i] == b' ' || bytes[i] == b'-')
                && sep.is_none_or(|s| s == bytes[i])
                && bytes[i + 1].is_ascii_digit();
            if !next_is_group {
                break;
            }
            sep = Some(bytes[i]);
            i += 1;
        }
        // Too long to be a card and not worth keeping.
        if digits.len() <= 40 && number_bounded(text, start..i) {
            runs.push(DigitRun {
                digits,
                span: start..i,
                groups,
            });
        }
    }
    runs
}

/// Expected IBAN length for an ISO 3166 country code, for the countries that
/// use IBANs.
pub fn iban_length(country: &str) -> Option<usize> {
    const LENGTHS: &[(&str, usize)] = &[
        ("AD", 24),
        ("AE", 23),
        ("AL", 28),
        ("AT", 20),
        ("AZ", 28),
        ("BA", 20),
        ("BE", 16),
        ("BG", 22),
        ("BH", 22),
        ("BR", 29),
        ("BY", 28),
        ("CH", 21),
        ("CR", 22),
        ("CY", 28),
        ("CZ", 24),
        ("DE", 22),
        ("DK", 18),
        ("DO", 28),
        ("EE", 20),
        ("EG", 29),
        ("ES", 24),
        ("FI", 18),
        ("FO", 18),
        ("FR", 27),
        ("GB", 22),
        ("GE", 22),
        ("GI", 23),
        ("GL", 18),
        ("GR", 27),
        ("GT", 28),
        ("HR", 21),
        ("HU", 28),
        ("IE", 22),
        ("IL", 23),
        ("IQ", 23),
        ("IS", 26),
        ("IT", 27),
        ("JO", 30),
        ("KW", 30),
        ("KZ", 20),
        ("LB", 28),
        ("LC", 32),
        ("LI", 21),
        ("LT", 20),
        ("LU", 20),
        ("LV", 21),
        ("MC", 27),
        ("MD", 24),
        ("ME", 22),
        ("MK", 19),
        ("MR", 27),
        ("MT", 31),
        ("MU", 30),
        ("NL", 18),
        ("NO", 15),
        ("PK", 24),
        ("PL", 28),
        ("PS", 29),
        ("PT", 25),
        ("QA", 29),
        ("RO", 24),
        ("RS", 22),
        ("SA", 24),
        ("SC", 31),
        ("SE", 24),
        ("SI", 19),
        ("SK", 24),
        ("SM", 27),
        ("ST", 25),
        ("SV", 28),
        ("TL", 23),
        ("TN", 24),
        ("TR", 26),
        ("UA", 29),
        ("VA", 22),
        ("VG", 24),
        ("XK", 20),
    ];
    LENGTHS
        .iter()
        .find(|(cc, _)| cc.eq_ignore_ascii_case(country))
        .map(|&(_, len)| len)
}

/// ISO 13616 remainder of an IBAN (spaces ignored); a valid IBAN gives 1.
/// `None` when the text contains anything but ASCII letters, digits and spaces.
pub fn iban_mod97(iban: &str) -> Option<u32> {
    let compact: Vec<u8> = iban.bytes().filter(|&b| b != b' ').collect();
    if compact.len() < 5 || !compact.iter().all(u8::is_ascii_alphanumeric) {
        return None;
    }
    let (head, tail) = compact.split_at(4);
    let mut rem = 0u32;
    for &b in tail.iter().chain(head) {
        let value = if b.is_ascii_digit() {
            u32::from(b - b'0')
        } else {
            u32::from(b.to_ascii_uppercase() - b'A') + 10
        };
        rem = if value >= 10 {
            (rem * 100 + value) % 97
        } else {
            (rem * 10 + value) % 97
        };
    }
    Some(rem)
}

/// A full IBAN check: known country, the country's length, check digits in
/// 02..=98, and mod-97 remainder 1.
pub fn iban_valid(iban: &str) -> bool {
    let compact: String = iban.chars().filter(|c| *c != ' ').collect();
    if compact.len() < 5 || !compact.is_ascii() {
        return false;
    }
    let country_ok = compact[..2].bytes().all(|b| b.is_ascii_alphabetic());
    let check: Option<u32> = compact[2..4].parse().ok();
    country_ok
        && iban_length(&compact[..2]) == Some(compact.len())
        && check.is_some_and(|c| (2..=98).contains(&c))
        && iban_mod97(&compact) == Some(1)
}

const FILE_EXTENSIONS: &[&str] = &[
    "png", "jpg", "jpeg", "gif", "svg", "webp", "bmp", "ico", "css", "js", "mjs", "ts", "tsx",
    "jsx", "json", "yaml", "yml", "toml", "lock", "txt", "md", "html", "htm", "xml", "pdf", "zip",
];

/// Addresses that cannot reach a person: documentation placeholders, RFC 2606
/// reserved domains, file names like `logo@2x.png`, SSH remotes and no-reply
/// senders. Keeping them out is what makes `pii-confirmed` trustworthy.
fn is_placeholder_email(email: &str) -> bool {
    const LOCALS: &[&str] = &[
        "user",
        "username",
        "name",
        "yourname",
        "your.name",
        "your_name",
        "youremail",
        "your.email",
        "email",
        "someone",
        "somebody",
        "foo",
        "bar",
        "test",
        "me",
        "you",
        "john.doe",
        "jane.doe",
        "johndoe",
        "janedoe",
        "firstname.lastname",
        "first.last",
        "git",
        "noreply",
        "no-reply",
        "donotreply",
        "do-not-reply",
        "mailer-daemon",
        "postmaster",
    ];
    const DOMAINS: &[&str] = &[
        "example.com",
        "example.org",
        "example.net",
        "domain.com",
        "yourdomain.com",
        "mydomain.com",
        "yourcompany.com",
        "company.com",
        "email.com",
        "test.com",
    ];
    let lower = email.to_ascii_lowercase();
    let Some((local, domain)) = lower.rsplit_once('@') else {
        return true;
    };
    let tld = domain.rsplit('.').next().unwrap_or_default();
    LOCALS.contains(&local)
        || DOMAINS.contains(&domain)
        || DOMAINS.iter().any(|d| domain.ends_with(&format!(".{d}")))
        || [".example", ".test", ".invalid", ".localhost", ".local"]
            .iter()
            .any(|suffix| domain.ends_with(suffix))
        || FILE_EXTENSIONS.contains(&tld)
}

/// Documentation placeholders (`sk-xxxx...`, AWS's `...EXAMPLE` keys,
/// `<token>`) are not secrets.
fn is_placeholder_secret(s: &str) -> bool {
    let lower = s.to_ascii_lowercase();
    let distinct = {
        let mut seen = [false; 256];
        s.bytes().for_each(|b| seen[usize::from(b)] = true);
        seen.iter().filter(|&&x| x).count()
    };
    distinct <= 4
        || lower.contains("example")
        || lower.contains("your")
        || lower.contains("placeholder")
        || lower.contains("redacted")
        || lower.contains("xxxx")
        || lower.contains("****")
        || lower.contains("...")
        || lower.contains("changeme")
        || lower.contains("<")
        || lower.contains("${")
        || lower.contains("{{")
        || matches!(
            lower.as_str(),
            "password" | "pass" | "passwd" | "secret" | "token" | "pwd" | "none" | "null"
        )
}

/// Decides whether `key = value` leaks a credential. Code is full of such
/// assignments whose value is a variable, a call or a type, so only literal
/// values count, and pure words are only suspected.
fn judge_assigned_secret(key: &str, value: &str, quoted: bool) -> Option<Strength> {
    const NOT_SECRETS: &[&str] = &[
        "required",
        "optional",
        "string",
        "str",
        "null",
        "none",
        "nil",
        "true",
        "false",
        "hidden",
        "masked",
        "undefined",
        "empty",
        "bool",
        "boolean",
        "integer",
        "number",
        "int",
        "text",
        "secret",
        "password",
        "token",
        "string,",
        "sensitive",
    ];
    let lower = value.to_ascii_lowercase();
    let key_lower = key.to_ascii_lowercase();
    // The key's last word repeated in the value (`password=password123`,
    // `token: my_token`) marks a template, not a secret.
    let key_word = key_lower
        .rsplit(|c: char| !c.is_ascii_alphanumeric())
        .find(|w| !w.is_empty())
        .unwrap_or_default();
    if value.len() < 6
        || lower == key_lower
        || (key_word.len() >= 3 && lower.contains(key_word))
        || NOT_SECRETS.contains(&lower.as_str())
        || is_placeholder_secret(value)
        || value.contains(['(', ')', '[', ']', '{', '}', '<', '>', '$', '%'])
    {
        return None;
    }
    let identifier = value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
    if !quoted && identifier {
        // `password=self.password`, `token = os.environ.get...` style lookups.
        let has_digit = value.bytes().any(|b| b.is_ascii_digit());
        let dotted_path = value.contains('.');
        let env_name = value
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b == b'_' || b.is_ascii_digit());
        if dotted_path || env_name || !has_digit {
            return None;
        }
    }
    if quoted || char_classes(value) >= 2 {
        Some(Strength::Confirmed)
    } else {
        Some(Strength::Suspected)
    }
}

/// Heuristic for machine-generated secrets: long, mixes letters and digits,
/// spreads its symbols evenly, and does not read like words or a hex digest.
fn looks_random(token: &str) -> bool {
    let len = token.len();
    if len < 20 || is_placeholder_secret(token) {
        return false;
    }
    let digits = token.bytes().filter(u8::is_ascii_digit).count();
    let upper = token.bytes().filter(u8::is_ascii_uppercase).count();
    let lower = token.bytes().filter(u8::is_ascii_lowercase).count();
    if digits < 2 || upper < 2 || lower < 2 {
        return false;
    }
    let word_like_runs = token
        .split(|c: char| !c.is_ascii_lowercase())
        .filter(|run| run.len() >= 4)
        .count();
    if word_like_runs >= 3 {
        return false;
    }
    let threshold = ((len as f64).log2() - 0.7).min(4.0);
    shannon_entropy(token) >= threshold
}

/// Compiles every pattern of this module now rather than on first use.
pub(crate) fn warm_up() {
    LazyLock::force(&EMAIL);
    LazyLock::force(&PHONE_INTL);
    LazyLock::force(&PHONE_US);
    LazyLock::force(&PHONE_AFTER_KEYWORD);
    LazyLock::force(&PHONE_VERB_AT);
    LazyLock::force(&PHONE_CONTEXT);
    LazyLock::force(&CODE_CONTEXT);
    LazyLock::force(&SSN_CONTEXT);
    LazyLock::force(&SSN_DISCLOSURE);
    LazyLock::force(&CARD_CONTEXT);
    LazyLock::force(&IBAN_CANDIDATE);
    LazyLock::force(&IBAN_CONTEXT);
    LazyLock::force(&KEY_FORMAT);
    LazyLock::force(&PEM_PRIVATE_KEY);
    LazyLock::force(&URL_CREDENTIALS);
    LazyLock::force(&BEARER);
    LazyLock::force(&ANCHORS);
    LazyLock::force(&DIGEST_PREFIX);
    LazyLock::force(&SECRET_CONTEXT);
    LazyLock::force(&STREET_ADDRESS);
    LazyLock::force(&DATE_OF_BIRTH);
    LazyLock::force(&DISCLOSURE);
    LazyLock::force(&DATE_OR_VERSION);
}

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).expect("built-in pattern compiles")
}

static EMAIL: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?-u:\b)[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9][A-Za-z0-9-]*(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}(?-u:\b)",
    )
});

static PHONE_INTL: LazyLock<Regex> =
    LazyLock::new(|| re(r"\+[1-9][0-9]{0,3}(?:[ .-]?\(?[0-9]{1,5}\)?){1,6}"));

// North American numbers need separators: ten bare digits are as likely to be
// an id as a phone. Area code and exchange cannot start with 0 or 1.
static PHONE_US: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:(?-u:\b)1[-. ])?(?:\(([2-9][0-9]{2})\) ?|([2-9][0-9]{2})([-. ]))[2-9][0-9]{2}([-. ])[0-9]{4}",
    )
});

static PHONE_AFTER_KEYWORD: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:phone|tel|telephone|mobile|cell|cellphone|fax|whatsapp|call|dial|text me|reach me|my number|contact number)(?-u:\b)(?:[\s:#=.,-]|(?-u:\b)(?:number|num|no|nr|is|at|on|me|us)(?-u:\b))*(\+?\(?[0-9][0-9 ().-]{5,22}[0-9])",
    )
});

// "text my wife at 07700 900123", "call the front desk on 020 7946 0958".
static PHONE_VERB_AT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:call|text|ring|phone|reach|contact|sms|whatsapp)(?-u:\b)(?:\s+[A-Za-z']+){0,3}\s+(?:at|on)\s+(\+?\(?[0-9][0-9 ().-]{5,22}[0-9])",
    )
});

static PHONE_CONTEXT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:phone|tel|telephone|mobile|cell|fax|call|text|sms|whatsapp|contact|reach|dial)",
    )
});

/// Words that mark a nearby number as an identifier of a thing, not a person.
static CODE_CONTEXT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:order|invoice|tracking|shipment|sku|serial|part|model|ticket|case|ref|reference|isbn|po|confirmation|booking|reservation|item|product|batch|lot|build|version|ver|id|transaction|txn|receipt|issue|pr|commit|job|request)(?-u:\b)",
    )
});

static SSN_CONTEXT: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?i)(?-u:\b)(?:ssn|ssns|ss#|social security|social sec|soc\.? sec)"));

/// "my SSN is" with or without a number: the user is handing one over.
static SSN_DISCLOSURE: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:(?:my|his|her|their|your|our|the patient'?s|the client'?s|the customer'?s|the employee'?s)\s+(?:ssn|social security(?:\s+number)?|social)\s*(?:#|no\.?|number)?\s*(?:is|was|:|=|-)|(?:ssn|social security number)\s*(?:#|no\.?)?\s*[:=]\s*\S)",
    )
});

static CARD_CONTEXT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:card|cc|visa|mastercard|amex|american express|discover|credit|debit|cvv|cvc|pan|payment|pay|paid|charge|billing)(?-u:\b)",
    )
});

static IBAN_CANDIDATE: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?-u:\b)[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?(?-u:\b)")
});

static IBAN_CONTEXT: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?i)(?-u:\b)(?:iban|bank account|account|wire|transfer)(?-u:\b)"));

/// Vendor key formats, each distinctive enough that a match is a key: OpenAI
/// and Anthropic secret keys, AWS access key ids, GitHub, GitLab, Slack,
/// Google, Stripe, SendGrid, Hugging Face and npm tokens, and JSON Web Tokens.
/// One alternation so that the whole family costs a single pass.
static KEY_FORMAT: LazyLock<Regex> = LazyLock::new(|| {
    let alternatives: &[&str] = &[
        r"(?-u:\b)sk-(?:proj-|ant-(?:api[0-9]{2}-)?|svcacct-|live-)?[A-Za-z0-9_-]{20,}",
        r"(?-u:\b)(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA)[A-Z0-9]{16}(?-u:\b)",
        r"(?-u:\b)(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{40,255})(?-u:\b)",
        r"(?-u:\b)glpat-[A-Za-z0-9_-]{20,}",
        r"(?-u:\b)xox[abposr]-[A-Za-z0-9-]{10,}",
        r"https://hooks\.slack\.com/services/[A-Za-z0-9/_-]{20,}",
        r"(?-u:\b)AIza[0-9A-Za-z_-]{35}",
        r"(?-u:\b)(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}",
        r"(?-u:\b)SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}",
        r"(?-u:\b)hf_[A-Za-z0-9]{30,}",
        r"(?-u:\b)npm_[A-Za-z0-9]{36}(?-u:\b)",
        r"(?-u:\b)eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
    ];
    re(&alternatives.join("|"))
});

static PEM_PRIVATE_KEY: LazyLock<Regex> =
    LazyLock::new(|| re(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"));

static URL_CREDENTIALS: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?i)(?-u:\b)[a-z][a-z0-9+.-]{1,15}://[^\s:/@]{1,64}:([^\s@/]{3,128})@[A-Za-z0-9.-]+")
});

static BEARER: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?i)(?-u:\b)(?:bearer|token)\s+([A-Za-z0-9._~+/-]{20,}=*)"));

/// Keywords for [`Scan::keyword_windows`]; longer words first, because the
/// leftmost-first alternation would otherwise report `pass` for `passport`.
/// A pure literal alternation (word boundaries are checked by the caller)
/// lets the regex engine run it as a fast multi-substring search.
static ANCHORS: LazyLock<Regex> = LazyLock::new(|| {
    let mut words = vec![
        "ssn",
        "social",
        "soc",
        "ss#",
        "dob",
        "d.o.b",
        "birth",
        "born",
        "passport",
        "licen",
        "account",
        "routing",
        "card",
        "address",
        "tax id",
        "medical record",
        "mrn",
        "insurance",
        "pin",
        "pass",
        "pwd",
        "secret",
        "key",
        "token",
        "phone",
        "tel",
        "mobile",
        "cell",
        "fax",
        "whatsapp",
        "dial",
        "call",
        "text",
        "ring",
        "reach",
        "contact",
        "sms",
        "my number",
    ];
    words.sort_by_key(|w| std::cmp::Reverse(w.len()));
    re(&words
        .iter()
        .map(|w| regex::escape(w))
        .collect::<Vec<_>>()
        .join("|"))
});

static DIGEST_PREFIX: LazyLock<Regex> =
    LazyLock::new(|| re(r"^(?i:sha(?:1|224|256|384|512)-|md5-)"));

static SECRET_CONTEXT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:key|keys|secret|token|password|passwd|credential|credentials|api|auth|authorization)(?-u:\b)",
    )
});

static STREET_ADDRESS: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?-u:\b)[0-9]{1,5}[A-Za-z]? (?:[A-Z][a-z]+\.? ){1,3}(?:Street|St|Avenue|Ave|Road|Rd|Boulevard|Blvd|Lane|Ln|Drive|Dr|Court|Ct|Way|Place|Pl|Terrace|Parkway|Pkwy|Circle|Highway|Hwy)(?-u:\b)",
    )
});

static DATE_OF_BIRTH: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:dob|d\.o\.b\.|date of birth|born on|birthday is)\s*[:=-]?\s*(?:[0-9]{1,4}[/.-][0-9]{1,2}[/.-][0-9]{1,4}|[A-Za-z]+ [0-9]{1,2},? [0-9]{4}|[0-9]{1,2} [A-Za-z]+ [0-9]{4})",
    )
});

static DISCLOSURE: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?-u:\b)(?:my|his|her|their|the patient'?s|the customer'?s|the client'?s)\s+(?:passport(?:\s+number|\s+no\.?)?|driver'?s\s+licen[cs]e(?:\s+number)?|date of birth|dob|bank account(?:\s+number)?|account number|routing number|credit card(?:\s+number)?|card number|home address|address|tax id|medical record number|mrn|national insurance number|pin)\s*(?:is|was|:|=)",
    )
});

static DATE_OR_VERSION: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"^(?:[0-9]{4}[-./][0-9]{1,2}[-./][0-9]{1,2}|[0-9]{1,2}[-./][0-9]{1,2}[-./][0-9]{2,4}|[0-9]{1,3}\.[0-9]{1,3}\.[0-9]+(?:\.[0-9]+)*)$",
    )
});

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(prompt: &str) -> (Verdict, Verdict) {
        let r = analyze(prompt, DEFAULT_MAX_BYTES);
        (r.pii, r.ssn)
    }

    fn pii(prompt: &str) -> Verdict {
        verdicts(prompt).0
    }

    fn kinds(prompt: &str) -> Vec<(PiiKind, Strength)> {
        analyze(prompt, DEFAULT_MAX_BYTES)
            .findings
            .iter()
            .map(|f| (f.kind, f.strength))
            .collect()
    }

    #[test]
    fn luhn() {
        assert!(luhn_valid("4111111111111111"));
        assert!(luhn_valid("4539578763621486"));
        assert!(luhn_valid("378282246310005"));
        assert!(luhn_valid("6011111111111117"));
        assert!(luhn_valid("0"));
        assert!(!luhn_valid("4111111111111112"));
        assert!(!luhn_valid("1234567812345678"));
        assert!(!luhn_valid(""));
        assert!(!luhn_valid("4111-1111"));
    }

    #[test]
    fn card_brands() {
        assert_eq!(card_brand("4111111111111111"), Some(CardBrand::Visa));
        assert_eq!(card_brand("5555555555554444"), Some(CardBrand::Mastercard));
        assert_eq!(card_brand("2223003122003222"), Some(CardBrand::Mastercard));
        assert_eq!(card_brand("378282246310005"), Some(CardBrand::Amex));
        assert_eq!(card_brand("6011111111111117"), Some(CardBrand::Discover));
        assert_eq!(card_brand("3530111333300000"), Some(CardBrand::Jcb));
        assert_eq!(card_brand("30569309025904"), Some(CardBrand::Diners));
        assert_eq!(card_brand("1234567812345670"), None);
        assert_eq!(
            card_brand("411111111111111"),
            None,
            "Visa is never 15 digits"
        );
    }

    #[test]
    fn cards_in_text() {
        assert_eq!(
            pii("charge it to 4111 1111 1111 1111 please"),
            Verdict::Confirmed
        );
        assert_eq!(pii("card: 5555-5555-5555-4444"), Verdict::Confirmed);
        assert_eq!(pii("amex 3782 822463 10005"), Verdict::Confirmed);
        assert_eq!(pii("4539578763621486"), Verdict::Confirmed);
        // Grouped like a card but failing Luhn: only suspected.
        assert_eq!(pii("use 4111 1111 1111 1112 for it"), Verdict::Suspected);
        assert_eq!(pii("my card number 1234567812345678"), Verdict::Suspected);
        // Long numbers that are not cards.
        assert_eq!(pii("order 4111111111111111 shipped"), Verdict::None);
        assert_eq!(pii("timestamp 1700000000000 ms"), Verdict::None);
        assert_eq!(pii("1234 5678 9012 3456 7890 1234 5678 90"), Verdict::None);
        assert_eq!(pii("v4.111.111.111.111.111"), Verdict::None);
        assert_eq!(pii("sort 4521 8834 1102 9987 3310"), Verdict::None);
        assert_eq!(pii("years 1999 2000 2001 2002"), Verdict::None);
        // Card context may follow the number.
        assert_eq!(pii("1234 5678 9012 3456 is on my card"), Verdict::Suspected);
    }

    #[test]
    fn iban_checks() {
        assert!(iban_valid("DE89 3704 0044 0532 0130 00"));
        assert!(iban_valid("GB82WEST12345698765432"));
        assert!(iban_valid("FR14 2004 1010 0505 0001 3M02 606"));
        assert!(iban_valid("NL91ABNA0417164300"));
        assert!(iban_valid("CH9300762011623852957"));
        assert_eq!(iban_mod97("GB82WEST12345698765432"), Some(1));
        assert!(
            !iban_valid("DE89 3704 0044 0532 0130 01"),
            "check digits broken"
        );
        assert!(!iban_valid("GB82WEST1234569876543"), "wrong length");
        assert!(!iban_valid("QQ82WEST12345698765432"), "unknown country");
        assert!(!iban_valid("DE"));
        assert!(!iban_valid("DÉ89 3704"));
        assert_eq!(iban_mod97("ab"), None);
        assert_eq!(iban_length("de"), Some(22));
    }

    #[test]
    fn ibans_in_text() {
        assert_eq!(
            pii("Please wire it to DE89 3704 0044 0532 0130 00 today"),
            Verdict::Confirmed
        );
        assert_eq!(pii("IBAN GB82WEST12345698765432."), Verdict::Confirmed);
        assert_eq!(pii("IBAN: DE89 3704 0044 0532 0130 01"), Verdict::Suspected);
        assert_eq!(pii("Part AB12 CDEF 3456 GHIJ arrived"), Verdict::None);
    }

    #[test]
    fn ssn_rules() {
        assert!(ssn_valid(123, 45, 6789));
        assert!(ssn_valid(899, 99, 9999));
        assert!(!ssn_valid(0, 12, 3456), "area 000");
        assert!(!ssn_valid(666, 12, 3456), "area 666");
        assert!(!ssn_valid(900, 12, 3456), "area 9xx");
        assert!(!ssn_valid(123, 0, 3456), "group 00");
        assert!(!ssn_valid(123, 45, 0), "serial 0000");
        assert!(!ssn_valid(78, 5, 1120), "published Woolworth number");
        assert_eq!(parse_ssn("123-45-6789"), Some((123, 45, 6789)));
        assert_eq!(parse_ssn("123456789"), Some((123, 45, 6789)));
        assert_eq!(parse_ssn("12345678"), None);
        assert_eq!(parse_ssn("12a456789"), None);
    }

    #[test]
    fn ssns_in_text() {
        use Verdict::*;
        assert_eq!(verdicts("SSN 123-45-6789"), (Confirmed, Confirmed));
        assert_eq!(
            verdicts("her number is 536-22-1984, file it"),
            (Confirmed, Confirmed)
        );
        assert_eq!(verdicts("ssn: 536221984"), (Confirmed, Confirmed));
        assert_eq!(
            verdicts("social security 536 22 1984"),
            (Confirmed, Confirmed)
        );
        assert_eq!(verdicts("SSN 666-12-3456"), (Suspected, Suspected));
        assert_eq!(verdicts("SSN 912-12-3456"), (Suspected, Suspected));
        assert_eq!(
            verdicts("my ssn is in the attached file"),
            (Suspected, Suspected)
        );
        assert_eq!(verdicts("How are SSNs structured?"), (None, None));
        assert_eq!(verdicts("Order 123-45-6789 shipped"), (None, None));
        assert_eq!(verdicts("the range 536 22 1984 in the table"), (None, None));
        assert_eq!(verdicts("000-12-3456"), (None, None));
        assert_eq!(verdicts("ID-123-45-6789"), (None, None));
    }

    #[test]
    fn emails() {
        assert_eq!(
            pii("mail maria.gonzalez@gmail.com for details"),
            Verdict::Confirmed
        );
        assert_eq!(pii("contact: j_smith+work@uni.ac.uk"), Verdict::Confirmed);
        assert_eq!(pii("e.g. user@example.com"), Verdict::None);
        assert_eq!(pii("git@github.com:org/repo.git"), Verdict::None);
        assert_eq!(pii("use logo@2x.png on retina"), Verdict::None);
        assert_eq!(pii("npm i lodash@4.17.21"), Verdict::None);
        assert_eq!(pii("@app.route('/x')"), Verdict::None);
    }

    #[test]
    fn phones() {
        assert_eq!(pii("call +44 20 7946 0958"), Verdict::Confirmed);
        assert_eq!(pii("+1 (415) 555-0132"), Verdict::Confirmed);
        assert_eq!(pii("reach me at (415) 555-0132"), Verdict::Confirmed);
        assert_eq!(pii("phone: 415-555-0132"), Verdict::Confirmed);
        assert_eq!(pii("Tel. 030 901820 41"), Verdict::Confirmed);
        assert_eq!(pii("1-800-555-0199"), Verdict::Suspected);
        assert_eq!(pii("text my wife at 07700 900123"), Verdict::Confirmed);
        assert_eq!(pii("call the desk on 020 7946 0958"), Verdict::Confirmed);
        assert_eq!(pii("meet them at 10.30 on 2024-06-01"), Verdict::None);
        assert_eq!(pii("it is 415-555-0132"), Verdict::Suspected);
        assert_eq!(pii("SKU 415-555-0132"), Verdict::None);
        assert_eq!(pii("released 2023-10-12"), Verdict::None);
        assert_eq!(pii("version 10.2.3"), Verdict::None);
        assert_eq!(pii("server 192.168.100.200"), Verdict::None);
        assert_eq!(pii("answer is 4155550132"), Verdict::None);
        assert_eq!(
            pii("the mobile app version 2.3.14159265 crashed"),
            Verdict::None
        );
        assert_eq!(pii("x = 3 +12"), Verdict::None);
    }

    #[test]
    fn key_formats() {
        let cases = [
            "sk-proj-4fJ9kL2mN8pQ7rS1tU6vW3xY0zA5bC",
            "sk-ant-api03-Zx81Kd92LmQ0pRt7Yu4Vb6Nc3Wq5Ea1S",
            "AKIAQ3EGRT5K7ZVN2WXP",
            "ghp_8aK2mZ9qL4xR7tV1nB6cD3fG5hJ0kP2sW4yE",
            "xoxb-2748163509-9081726354-Hk3Lm9Pq2Rs7Tv",
            "AIzaSyD8k3Lm9Pq2Rs7Tv4Wx6Yz1Ab5Cd0Ef3Gh",
            "sk_live_51HqL2mK9pR4tV7xZ0bC3dF6g",
            "glpat-9xK2mL4pQ7rT1vW3yZ5b",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk",
            "-----BEGIN RSA PRIVATE KEY-----",
            "-----BEGIN OPENSSH PRIVATE KEY-----",
            "-----BEGIN PRIVATE KEY-----",
        ];
        for key in cases {
            assert_eq!(pii(&format!("here: {key} ok")), Verdict::Confirmed, "{key}");
        }
        assert_eq!(
            pii("AKIAIOSFODNN7EXAMPLE"),
            Verdict::None,
            "AWS documentation key"
        );
        assert_eq!(
            pii("export OPENAI_API_KEY=sk-xxxxxxxxxxxxxxxxxxxxxxxx"),
            Verdict::None
        );
        assert_eq!(pii("-----BEGIN PUBLIC KEY-----"), Verdict::None);
        assert_eq!(pii("-----BEGIN CERTIFICATE-----"), Verdict::None);
        assert_eq!(
            pii("pip install scikit-learn sk-learn-helpers"),
            Verdict::None
        );
    }

    #[test]
    fn credentials() {
        assert_eq!(pii("DB_PASSWORD=S3cr3t!2024"), Verdict::Confirmed);
        assert_eq!(pii("SMTP_PASS='Qw3rty!9'"), Verdict::Confirmed);
        assert_eq!(pii("bypass = true; compass: 'north'"), Verdict::None);
        assert_eq!(
            pii(&format!("token={}", "q8Zr2LmX9vBt".repeat(30))),
            Verdict::None,
            "a 360-byte value is data, not a credential"
        );
        assert_eq!(pii(r#"{"password": "hunter22"}"#), Verdict::Confirmed);
        assert_eq!(
            pii("postgres://admin:Pa55w0rd@db.internal:5432/app"),
            Verdict::Confirmed
        );
        assert_eq!(
            pii("Authorization: Bearer 9f8Kq2LmZ7xR4tV1nB6cD3fG5hJ0kP"),
            Verdict::Confirmed
        );
        assert_eq!(
            pii("password: sunshine"),
            Verdict::None,
            "unquoted word: a variable"
        );
        assert_eq!(pii("password = request.form['password']"), Verdict::None);
        assert_eq!(pii("password := os.Getenv(\"DB_PASSWORD\")"), Verdict::None);
        assert_eq!(pii("api_key = settings.api_key"), Verdict::None);
        assert_eq!(pii("token = ${GITHUB_TOKEN}"), Verdict::None);
        assert_eq!(pii("password: String,"), Verdict::None);
        assert_eq!(pii("max_tokens: 512000"), Verdict::None);
        assert_eq!(pii("password: <your-password>"), Verdict::None);
        assert_eq!(pii("postgres://user:password@localhost/db"), Verdict::None);
    }

    #[test]
    fn high_entropy_tokens() {
        assert_eq!(
            pii("use q8Zr2LmX9vBt4KpW7sYc1NdE5hJg3FaU to log in"),
            Verdict::Suspected
        );
        assert_eq!(
            pii("my api key is q8Zr2LmX9vBt4KpW7sYc1NdE5hJg3FaU"),
            Verdict::Confirmed
        );
        assert_eq!(
            pii("commit 3f9a1c2e8b7d6a5f4e3d2c1b0a9f8e7d6c5b4a39"),
            Verdict::None
        );
        assert_eq!(
            pii("id 550e8400-e29b-41d4-a716-446655440000"),
            Verdict::None
        );
        assert_eq!(
            pii("AbstractSingletonProxyFactoryBeanConfiguration2"),
            Verdict::None
        );
        assert_eq!(
            pii("see https://docs.google.com/d/1BxiMVs0XRA5nFMdKvBdBZjgmUUqptlbs74OgvE2upms"),
            Verdict::None
        );
        assert_eq!(
            pii(
                r#"integrity="sha384-oqVuAfXRKap7fdgcCY5uykM6+R9GqQ8K/uxy9rx7HNQlGYl1kPzQho1wx4JwY8wC""#
            ),
            Verdict::None
        );
    }

    #[test]
    fn personal_details() {
        assert_eq!(
            pii("ship to 742 Evergreen Terrace, Springfield"),
            Verdict::Suspected
        );
        assert_eq!(pii("DOB: 04/12/1987"), Verdict::Suspected);
        assert_eq!(
            pii("my passport number is in my other bag"),
            Verdict::Suspected
        );
        assert_eq!(pii("How do I renew my passport?"), Verdict::None);
        assert!(kinds("221B Baker Street").contains(&(PiiKind::Address, Strength::Suspected)));
    }

    #[test]
    fn unknown_when_blank_or_too_large() {
        assert_eq!(verdicts(""), (Verdict::Unknown, Verdict::Unknown));
        assert_eq!(verdicts(" \n\t "), (Verdict::Unknown, Verdict::Unknown));
        assert_eq!(
            classify_pii_with_limit("hello world", 5),
            vec!["pii-unknown", "ssn-unknown"]
        );
        assert_eq!(
            classify_pii_with_limit("hello", 5),
            vec!["pii-none", "ssn-none"]
        );
        let big = "a".repeat(DEFAULT_MAX_BYTES + 1);
        assert_eq!(classify_pii(&big), vec!["pii-unknown", "ssn-unknown"]);
    }

    #[test]
    fn findings_are_capped() {
        let prompt = "ship to 742 Evergreen Terrace. ".repeat(MAX_FINDINGS * 3);
        let report = analyze(&prompt, DEFAULT_MAX_BYTES);
        assert_eq!(report.findings.len(), MAX_FINDINGS);
        assert_eq!(report.pii, Verdict::Suspected);
    }

    #[test]
    fn scanning_stops_once_settled() {
        let prompt = "a@gmail.com ".repeat(100);
        let report = analyze(&prompt, DEFAULT_MAX_BYTES);
        assert_eq!(report.findings.len(), 1);
        // The SSN verdict can still improve after the PII one is settled.
        let prompt = format!("{} then SSN 536-22-1984", "a@gmail.com ".repeat(100));
        let report = analyze(&prompt, DEFAULT_MAX_BYTES);
        assert_eq!(
            (report.pii, report.ssn),
            (Verdict::Confirmed, Verdict::Confirmed)
        );
    }

    #[test]
    fn spans_point_at_the_evidence() {
        let prompt = "mail bob.lee@proton.me now";
        let report = analyze(prompt, DEFAULT_MAX_BYTES);
        assert_eq!(
            &prompt[report.findings[0].span.clone()],
            "bob.lee@proton.me"
        );
    }
}
