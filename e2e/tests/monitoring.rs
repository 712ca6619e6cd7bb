//! The shipped alert rules and dashboard (`manifests/monitoring/`) name
//! only series the EPP and the operator export: each name a rule or a
//! panel's query reads must appear in the two binaries' own expositions
//! (besides Prometheus's `up`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kinference_e2e::cluster::yaml_documents_to_json;
use kinference_epp::endpoints::{EndpointSpec, ScrapedMetrics, endpoints_from_specs};
use kinference_epp::metrics::DecisionOutcome;
use kinference_epp::server::{Epp, Settings};

fn monitoring(file: &str) -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/monitoring/").to_string() + file;
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The PromQL of every alert rule.
fn rule_expressions() -> Vec<String> {
    let docs = yaml_documents_to_json(&monitoring("prometheus-rules.yaml")).unwrap();
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0]["kind"], "PrometheusRule");
    docs[0]["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .map(|r| r["expr"].as_str().unwrap().to_string())
        .collect()
}

/// The PromQL of every panel's target and template variable.
fn dashboard_expressions() -> Vec<String> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&monitoring("grafana-dashboard.json")).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let mut out: Vec<String> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().clone())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] == "query" {
            out.push(var["query"].as_str().unwrap().to_string());
        }
    }
    out
}

/// Series names in an expression, read from its syntax tree as Prometheus
/// parses it (promql-parser): an expression that does not parse fails the
/// test, as `promtool check rules` would. Grafana's `label_values(metric,
/// label)` (a variable query, not PromQL) names its metric first.
fn series_in(expr: &str) -> BTreeSet<String> {
    if let Some(args) = expr.trim().strip_prefix("label_values(") {
        let metric = args.split([',', ')']).next().unwrap_or_default().trim();
        return series_in(metric);
    }
    let tree = promql_parser::parser::parse(expr)
        .unwrap_or_else(|e| panic!("`{}` is not PromQL: {e}", expr.trim()));
    let mut out = BTreeSet::new();
    collect_series(&tree, &mut out);
    out
}

fn collect_series(expr: &promql_parser::parser::Expr, out: &mut BTreeSet<String>) {
    use promql_parser::parser::Expr;
    match expr {
        Expr::VectorSelector(vs) => out.extend(vs.name.clone()),
        Expr::MatrixSelector(ms) => out.extend(ms.vs.name.clone()),
        Expr::Aggregate(a) => {
            collect_series(&a.expr, out);
            if let Some(param) = &a.param {
                collect_series(param, out);
            }
        }
        Expr::Unary(u) => collect_series(&u.expr, out),
        Expr::Binary(b) => {
            collect_series(&b.lhs, out);
            collect_series(&b.rhs, out);
        }
        Expr::Paren(p) => collect_series(&p.expr, out),
        Expr::Subquery(q) => collect_series(&q.expr, out),
        Expr::Call(c) => c.args.args.iter().for_each(|a| collect_series(a, out)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// The series an exposition offers: every sample's name, and every
/// family's series by its type, samples or not (a counter `x` is
/// `x_total`; a histogram `x_bucket`, `x_sum` and `x_count`).
fn exported(exposition: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in exposition.lines().filter(|l| !l.is_empty()) {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            let (name, kind) = family.split_once(' ').unwrap();
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "info" => &["_info"],
                _ => &[""],
            };
            out.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') {
            out.insert(line.split(['{', ' ']).next().unwrap().to_string());
        }
    }
    out
}

/// The EPP's exposition with every family it can have filled in.
fn epp_exposition() -> String {
    let epp = Epp::new(Settings::default());
    epp.policy()
        .load_text("rules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n")
        .unwrap();
    let specs = ["10.0.0.1:8000", "10.0.0.2:8000"].map(|a| EndpointSpec::new(a, &["m"]));
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    for ep in epp.registry().endpoints() {
        epp.registry()
            .set_metrics(&ep.name, ScrapedMetrics::empty(Instant::now()));
    }
    let metrics = &epp.picker.metrics();
    metrics.pool.set_pool_name("pool");
    metrics.export_kv_index_states();
    metrics.set_ready(true);
    metrics.observe_decision("r", DecisionOutcome::Local, Duration::from_millis(1));
    metrics.observe_decision(
        "r",
        DecisionOutcome::Reject { status: 503 },
        Duration::from_millis(1),
    );
    // A request waits and another, of the same priority, finds no place.
    let flow = &epp.picker.flow();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _waiting = runtime.block_on(async {
        use kinference_epp::flow::{Bounds, Place};
        let place = Place {
            priority: 0,
            flow: String::new(),
            rule: "r".into(),
            bytes: 10,
        };
        let one = Bounds {
            requests: 1,
            bytes: 100,
        };
        let waiting = flow.enter(place.clone(), Duration::from_secs(1), one).ok();
        assert!(flow.enter(place, Duration::from_secs(1), one).is_err());
        waiting
    });
    metrics.observe_ttft_prediction(0.1, 0.12);
    metrics.observe_cached_prefix_prediction("estimate", 10.0, 12, 100);
    metrics.render(epp.registry(), Some("0123"))
}

#[test]
fn every_rule_and_panel_names_a_series_the_binaries_export() {
    let mut offered = exported(&epp_exposition());
    offered.extend(exported(&kinference_operator::Metrics::new().render()));
    offered.insert("up".to_string());
    let mut missing = Vec::new();
    let mut named = 0;
    for expr in rule_expressions()
        .into_iter()
        .chain(dashboard_expressions())
    {
        for series in series_in(&expr) {
            named += 1;
            if !offered.contains(&series) {
                missing.push(format!("{series} (in `{}`)", expr.trim()));
            }
        }
    }
    assert!(
        named >= 15,
        "only {named} series found: is the parser reading the files?"
    );
    assert!(
        missing.is_empty(),
        "not exported: {missing:#?}\nexported: {offered:#?}"
    );
}

#[test]
#[should_panic(expected = "is not PromQL")]
fn an_expression_that_does_not_parse_fails() {
    series_in("sum(rate(kinference_epp_decisions_total[5m]) by (rule)");
}

#[test]
fn the_series_parser_finds_names_and_skips_functions_labels_and_keywords() {
    let names = series_in(
        "sum by (rule, le) (rate(kinference_epp_decisions_total{outcome=\"local\", namespace=~\"$ns\"}[5m])) / on (pod) up > 0 and inference_pool_ready_pods",
    );
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "inference_pool_ready_pods",
            "kinference_epp_decisions_total",
            "up"
        ]
    );
}

/// The PodMonitors select what they scrape: the EPP Pods the operator
/// generates, by their labels and named metrics port, and the operator's
/// own Pod in `manifests/`.
#[test]
fn the_pod_monitors_select_the_epp_and_operator_pods_and_their_metrics_ports() {
    use kinference_operator::resources::{EppSettings, desired};
    let monitors = yaml_documents_to_json(&monitoring("pod-monitors.yaml")).unwrap();
    let selects = |name: &str, labels: &serde_json::Value, ports: &[&str]| {
        let monitor = monitors
            .iter()
            .find(|m| m["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no PodMonitor {name}"));
        for (key, value) in monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap()
        {
            assert_eq!(&labels[key], value, "{name}: label {key}");
        }
        for endpoint in monitor["spec"]["podMetricsEndpoints"].as_array().unwrap() {
            let port = endpoint["port"].as_str().unwrap();
            assert!(ports.contains(&port), "{name}: no port {port} in {ports:?}");
        }
    };

    let policy: kinference_api::InferencePolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "kinference.io/v1alpha1", "kind": "InferencePolicy",
        "metadata": {"name": "chat", "namespace": "llm", "uid": "4c5f7c2e-0000-4000-8000-000000000001"},
        "spec": {
            "pool": {"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}]},
            "rules": [{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]
        }
    }))
    .unwrap();
    let compiled = kinference_policy::compile(&policy.spec.policy).unwrap();
    let settings = EppSettings {
        image: "epp".into(),
        replicas: Some(1),
    };
    let deployment =
        serde_json::to_value(desired(&policy, &compiled, &settings).deployment).unwrap();
    let pod = &deployment["spec"]["template"];
    let ports: Vec<&str> = pod["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    selects("kinference-epp", &pod["metadata"]["labels"], &ports);

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/deployment.yaml");
    let operator = yaml_documents_to_json(&std::fs::read_to_string(path).unwrap()).unwrap();
    let template = &operator[0]["spec"]["template"];
    let ports: Vec<&str> = template["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    selects(
        "kinference-operator",
        &template["metadata"]["labels"],
        &ports,
    );
}

/// The alert rules as a plain Prometheus rule file (the PrometheusRule's
/// `spec`), written to `dir/rules.yaml` beside the alerts' unit tests.
fn write_rule_files(dir: &std::path::Path) -> std::path::PathBuf {
    let docs = yaml_documents_to_json(&monitoring("prometheus-rules.yaml")).unwrap();
    let groups = serde_json::json!({ "groups": docs[0]["spec"]["groups"] });
    std::fs::write(
        dir.join("rules.yaml"),
        serde_json::to_string_pretty(&groups).unwrap(),
    )
    .unwrap();
    let tests = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/prometheus-rules.tests.yaml"
    );
    std::fs::copy(tests, dir.join("tests.yaml")).unwrap();
    dir.join("rules.yaml")
}

/// `promtool <args>` in `dir`: its exit status and everything it printed.
fn promtool(dir: &std::path::Path, args: &[&str]) -> (bool, String) {
    let bin = kinference_e2e::tools::installed("promtool", "KINFERENCE_PROMTOOL").unwrap();
    let out = std::process::Command::new(bin)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Prometheus's own checks (promtool, from the Go module proxy): every
/// rule parses and is well formed, and each alert the unit tests cover
/// fires when, and with the labels and text, it should.
#[test]
fn promtool_passes_the_alert_rules_and_their_unit_tests() {
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rule_files(dir.path());
    let count = rule_expressions().len();
    let (ok, text) = promtool(dir.path(), &["check", "rules", rules.to_str().unwrap()]);
    assert!(ok, "promtool check rules: {text}");
    assert!(
        text.contains(&format!("SUCCESS: {count} rules found")),
        "{text}"
    );
    let (ok, text) = promtool(dir.path(), &["test", "rules", "tests.yaml"]);
    assert!(ok, "promtool test rules: {text}");
    assert!(text.contains("SUCCESS"), "{text}");
}

/// The unit tests can fail: an alert that fires later than a test expects
/// is reported.
#[test]
fn promtool_reports_an_alert_that_does_not_fire_when_expected() {
    let dir = tempfile::tempdir().unwrap();
    write_rule_files(dir.path());
    let tests = std::fs::read_to_string(dir.path().join("tests.yaml")).unwrap();
    // The not-ready alert waits 5 minutes: at 4 it cannot have fired.
    let broken = tests.replacen("- eval_time: 7m", "- eval_time: 4m30s", 1);
    assert_ne!(broken, tests);
    std::fs::write(dir.path().join("tests.yaml"), broken).unwrap();
    let (ok, text) = promtool(dir.path(), &["test", "rules", "tests.yaml"]);
    assert!(!ok, "{text}");
    assert!(text.contains("KinferenceEppNotReady"), "{text}");
}
