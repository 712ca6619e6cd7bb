//! vLLM's KV-cache events on the wire: ZMQ multipart messages of three
//! frames (topic, sequence number, msgpack payload), the payload an
//! `EventBatch` `[ts, events, data_parallel_rank]`.
//!
//! Events come in two encodings, and both are accepted:
//! - vLLM <= 0.23 (and llm-d-inference-sim by default): each event a
//!   positional array with its class name first,
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name, extra_keys, group_idx, ...]`, shorter in
//!   older releases;
//! - vLLM >= 0.24: each event a map with its class name under `"type"`.
//!
//! Block hashes are 64-bit unsigned integers by default, or 32 raw bytes
//! with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`. They are only ever compared
//! with each other (the index re-hashes the token ids into its own chain),
//! so bytes are folded to 64 bits.
//!
//! Decoding is typed (serde over `rmp-serde`): token ids land in a
//! `Vec<u32>` and unknown fields are skipped without being built, so memory
//! stays within a small multiple of the payload, which the subscriber
//! bounds.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64;

/// An engine's block hash, as the engine published it (folded to 64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineBlock(pub u64);

/// One `EventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank; `None` when it has no data parallelism.
    pub data_parallel_rank: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    AllCleared,
}

/// Blocks the engine now holds: `token_ids` are the tokens of
/// `block_hashes.len()` consecutive full blocks of `block_size` tokens,
/// following the block `parent` (none: they start a sequence).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineBlock>,
    pub parent: Option<EngineBlock>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_name: Option<String>,
    pub medium: Option<String>,
    /// Some block's hash also covers data the tokens do not show (an
    /// image, a cache salt): its tokens alone cannot be matched.
    pub has_extra_keys: bool,
    /// The KV-cache group (hybrid models have several); `None` is group 0.
    pub group_idx: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineBlock>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    #[error("expected 3 frames (topic, sequence, payload), got {0}")]
    Frames(usize),
    #[error("sequence frame of {0} bytes, expected 8")]
    Sequence(usize),
    #[error("payload: {0}")]
    Payload(#[from] rmp_serde::decode::Error),
}

/// One message of the PUB socket.
#[derive(Debug)]
pub struct Message {
    pub topic: String,
    pub seq: u64,
    pub batch: EventBatch,
}

/// Reads one multipart message: `[topic, seq (8 bytes, big-endian), payload]`.
pub(crate) fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<Message, WireError> {
    let [topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    let seq: [u8; 8] = seq
        .as_ref()
        .try_into()
        .map_err(|_| WireError::Sequence(seq.as_ref().len()))?;
    Ok(Message {
        topic: String::from_utf8_lossy(topic.as_ref()).into_owned(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload.as_ref())?,
    })
}

/// Reads one `EventBatch` payload.
pub(crate) fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    Ok(rmp_serde::from_slice(payload)?)
}

impl<'de> Deserialize<'de> for EngineBlock {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EngineBlock;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<EngineBlock, E> {
                Ok(EngineBlock(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<EngineBlock, E> {
                // Same bits: only equality matters.
                Ok(EngineBlock(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<EngineBlock, E> {
                Ok(EngineBlock(xxh3_64(v)))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for EventBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EventBatch;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an EventBatch [ts, events, data_parallel_rank]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventBatch, A::Error> {
                let ts = seq
                    .next_element::<f64>()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let events = seq
                    .next_element::<Vec<KvEvent>>()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                let data_parallel_rank = seq.next_element::<Option<u32>>()?.flatten();
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank,
                })
            }
        }
        d.deserialize_seq(V)
    }
}

/// The fields of any event, as read from either encoding.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineBlock>>,
    parent: Option<EngineBlock>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_name: Option<String>,
    medium: Option<String>,
    has_extra_keys: bool,
    group_idx: Option<u32>,
}

/// `extra_keys`: one entry per block, `None` where the block has none.
struct ExtraKeys(bool);

impl<'de> Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let keys = Option::<Vec<Option<IgnoredAny>>>::deserialize(d)?;
        Ok(ExtraKeys(
            keys.is_some_and(|k| k.iter().any(Option::is_some)),
        ))
    }
}

impl Fields {
    fn into_event<E: de::Error>(self, kind: &str) -> Result<KvEvent, E> {
        let hashes =
            |h: Option<Vec<EngineBlock>>| h.ok_or_else(|| E::missing_field("block_hashes"));
        match kind {
            "BlockStored" => Ok(KvEvent::Stored(BlockStored {
                block_hashes: hashes(self.block_hashes)?,
                parent: self.parent,
                token_ids: self
                    .token_ids
                    .ok_or_else(|| E::missing_field("token_ids"))?,
                block_size: self
                    .block_size
                    .ok_or_else(|| E::missing_field("block_size"))?,
                lora_name: self.lora_name,
                medium: self.medium,
                has_extra_keys: self.has_extra_keys,
                group_idx: self.group_idx,
            })),
            "BlockRemoved" => Ok(KvEvent::Removed(BlockRemoved {
                block_hashes: hashes(self.block_hashes)?,
                medium: self.medium,
                group_idx: self.group_idx,
            })),
            "AllBlocksCleared" => Ok(KvEvent::AllCleared),
            other => Err(E::unknown_variant(
                other,
                &["BlockStored", "BlockRemoved", "AllBlocksCleared"],
            )),
        }
    }
}

/// Positional fields after the tag, per event class (vLLM <= 0.23).
const STORED_ORDER: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_ORDER: [&str; 3] = ["block_hashes", "medium", "group_idx"];

struct FieldSeed<'a> {
    name: &'a str,
    fields: &'a mut Fields,
}

impl<'de> de::DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        let f = self.fields;
        match self.name {
            "block_hashes" => f.block_hashes = Some(Deserialize::deserialize(d)?),
            "parent_block_hash" => f.parent = Deserialize::deserialize(d)?,
            "token_ids" => f.token_ids = Some(Deserialize::deserialize(d)?),
            "block_size" => f.block_size = Some(Deserialize::deserialize(d)?),
            "lora_name" => f.lora_name = Deserialize::deserialize(d)?,
            "medium" => f.medium = Deserialize::deserialize(d)?,
            "extra_keys" => f.has_extra_keys = ExtraKeys::deserialize(d)?.0,
            "group_idx" => f.group_idx = Deserialize::deserialize(d)?,
            _ => {
                IgnoredAny::deserialize(d)?;
            }
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for KvEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KvEvent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a KV event: a tagged array or a map with \"type\"")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KvEvent, A::Error> {
                let kind: String = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let order: &[&str] = match kind.as_str() {
                    "BlockStored" => &STORED_ORDER,
                    "BlockRemoved" => &REMOVED_ORDER,
                    _ => &[],
                };
                let mut fields = Fields::default();
                for name in order {
                    let seed = FieldSeed {
                        name,
                        fields: &mut fields,
                    };
                    if seq.next_element_seed(seed)?.is_none() {
                        break;
                    }
                }
                // Fields a later release appends.
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                fields.into_event(&kind)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEvent, A::Error> {
                let mut fields = Fields::default();
                let mut kind = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "type" {
                        kind = Some(map.next_value::<String>()?);
                    } else {
                        map.next_value_seed(FieldSeed {
                            name: &key,
                            fields: &mut fields,
                        })?;
                    }
                }
                let kind = kind.ok_or_else(|| de::Error::missing_field("type"))?;
                fields.into_event(&kind)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    //! Fixtures: payloads encoded by vLLM's own event classes and publisher
    //! (0.34.0, maps; 0.23.0, arrays), with a JSON of what each holds
    //! (`tests/fixtures/kv_events/gen.py` regenerates them).
    use super::*;
    use serde_json::Value;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_events");
    const NAMES: [&str; 7] = [
        "stored_int",
        "stored_child_int",
        "removed_int",
        "cleared",
        "mixed_bytes",
        "stored_negative_int",
        "stored_full_int",
    ];

    fn payload(name: &str, form: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}.{form}.msgpack")).unwrap()
    }

    fn block(v: &Value) -> EngineBlock {
        if let Some(hex) = v.get("bytes_hex").and_then(Value::as_str) {
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            return EngineBlock(xxh3_64(&bytes));
        }
        let n = &v["int"];
        EngineBlock(n.as_u64().unwrap_or_else(|| n.as_i64().unwrap() as u64))
    }

    /// The batch the fixture's JSON describes, as this module should read it.
    fn expected(name: &str) -> EventBatch {
        let text = std::fs::read_to_string(format!("{FIXTURES}/{name}.json")).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        let c = &json["content"];
        let blocks = |v: &Value| v.as_array().unwrap().iter().map(block).collect::<Vec<_>>();
        let string = |v: &Value| v.as_str().map(str::to_string);
        let events = c["events"].as_array().unwrap().iter().map(|e| {
            let group_idx = e.get("group_idx").and_then(Value::as_u64).map(|g| g as u32);
            match e["type"].as_str().unwrap() {
                "BlockStored" => KvEvent::Stored(BlockStored {
                    block_hashes: blocks(&e["block_hashes"]),
                    parent: (!e["parent_block_hash"].is_null())
                        .then(|| block(&e["parent_block_hash"])),
                    token_ids: e["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect(),
                    block_size: e["block_size"].as_u64().unwrap() as u32,
                    lora_name: string(&e["lora_name"]),
                    medium: string(&e["medium"]),
                    has_extra_keys: e
                        .get("extra_keys")
                        .and_then(Value::as_array)
                        .is_some_and(|k| k.iter().any(|x| !x.is_null())),
                    group_idx,
                }),
                "BlockRemoved" => KvEvent::Removed(BlockRemoved {
                    block_hashes: blocks(&e["block_hashes"]),
                    medium: string(&e["medium"]),
                    group_idx,
                }),
                "AllBlocksCleared" => KvEvent::AllCleared,
                other => panic!("{other}"),
            }
        });
        EventBatch {
            ts: c["ts"].as_f64().unwrap(),
            events: events.collect(),
            data_parallel_rank: c["data_parallel_rank"].as_u64().map(|r| r as u32),
        }
    }

    #[test]
    fn both_encodings_of_every_fixture_read_as_their_content() {
        for name in NAMES {
            for form in ["map", "array"] {
                let got = decode_batch(&payload(name, form))
                    .unwrap_or_else(|e| panic!("{name}.{form}: {e}"));
                assert_eq!(got, expected(name), "{name}.{form}");
            }
        }
    }

    #[test]
    fn hashes_above_i64_and_parents_keep_their_64_bits() {
        let batch = decode_batch(&payload("stored_child_int", "map")).unwrap();
        let KvEvent::Stored(s) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(s.parent, Some(EngineBlock(0xDEAD_BEEF_CAFE_F00D)));
        assert_eq!(s.block_hashes, [EngineBlock(u64::MAX)]);
        assert_eq!(s.token_ids, (32..48).collect::<Vec<u32>>());
    }

    #[test]
    fn the_array_form_of_vllm_0_23_keeps_the_lora_and_extra_keys() {
        let batch = decode_batch(&payload("stored_full_int", "array")).unwrap();
        let KvEvent::Stored(s) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(s.lora_name.as_deref(), Some("my-lora"));
        assert!(s.has_extra_keys);
        assert_eq!(s.group_idx, Some(1));
    }

    #[test]
    fn a_message_is_topic_big_endian_sequence_and_payload() {
        let frames = [
            b"kv@10.0.0.7@m".to_vec(),
            258u64.to_be_bytes().to_vec(),
            payload("cleared", "map"),
        ];
        let m = decode_message(&frames).unwrap();
        assert_eq!((m.topic.as_str(), m.seq), ("kv@10.0.0.7@m", 258));
        assert_eq!(m.batch.events, [KvEvent::AllCleared]);
        let two = [frames[0].clone(), frames[2].clone()];
        assert_eq!(
            decode_message(&two).unwrap_err().to_string(),
            "expected 3 frames (topic, sequence, payload), got 2"
        );
        let short_seq = [frames[0].clone(), vec![1, 2], frames[2].clone()];
        assert_eq!(
            decode_message(&short_seq).unwrap_err().to_string(),
            "sequence frame of 2 bytes, expected 8"
        );
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        for name in NAMES {
            for form in ["map", "array"] {
                let p = payload(name, form);
                for len in 0..p.len() {
                    assert!(
                        decode_batch(&p[..len]).is_err(),
                        "{name}.{form} cut at {len}"
                    );
                }
                for i in 0..p.len() {
                    let mut q = p.clone();
                    q[i] ^= 0xFF;
                    let _ = decode_batch(&q);
                }
            }
        }
    }

    #[test]
    fn an_unknown_event_class_is_named_in_the_error() {
        // [1.0, [["BlockMoved"]], nil]
        let p = [
            0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xaa, b'B', b'l', b'o', b'c',
            b'k', b'M', b'o', b'v', b'e', b'd', 0xc0,
        ];
        let err = decode_batch(&p).unwrap_err().to_string();
        assert!(err.contains("unknown variant `BlockMoved`"), "{err}");
    }

    #[test]
    fn a_declared_length_far_beyond_the_payload_allocates_nothing_large() {
        // [1.0, array32 of 2^32-1 events (none present)]
        let mut p = vec![
            0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
        ];
        p.push(0xc0);
        assert!(decode_batch(&p).is_err());
    }
}
