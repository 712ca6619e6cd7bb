//! JSON values as YAML text (for `kinference crds` and generated manifests).

use serde_json::Value as Json;
use yaml_rust2::yaml::Hash;
use yaml_rust2::{Yaml, YamlEmitter};

/// Renders a JSON value as a YAML document (with a leading `---`).
pub fn to_yaml(value: &Json) -> String {
    let mut out = String::new();
    let mut emitter = YamlEmitter::new(&mut out);
    emitter.multiline_strings(true);
    emitter
        .dump(&to_yaml_value(value))
        .expect("writing to a String cannot fail");
    out.push('\n');
    out
}

fn to_yaml_value(value: &Json) -> Yaml {
    match value {
        Json::Null => Yaml::Null,
        Json::Bool(b) => Yaml::Boolean(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => Yaml::Integer(i),
            None => Yaml::Real(n.to_string()),
        },
        Json::String(s) => Yaml::String(s.clone()),
        Json::Array(items) => Yaml::Array(items.iter().map(to_yaml_value).collect()),
        Json::Object(map) => {
            let mut hash = Hash::new();
            for (k, v) in map {
                hash.insert(Yaml::String(k.clone()), to_yaml_value(v));
            }
            Yaml::Hash(hash)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::parse_documents;

    #[test]
    fn round_trips_through_the_reader() {
        let value = serde_json::json!({
            "a": [1, 2.5, "x: y", true, null],
            "b": {"c": "multi\nline", "d": "123", "e": "true"}
        });
        let docs = parse_documents(&to_yaml(&value)).unwrap();
        assert_eq!(docs[0].value, value);
    }
}
