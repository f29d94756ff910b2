//! Headless Chromium driven through the DevTools protocol, for the view's
//! tests: real mouse and wheel events, the console, the requests the page
//! makes, screenshots. A WebSocket client (tungstenite) and a few lines of
//! JSON-RPC: the Rust CDP crates bring an async runtime or download a
//! browser, and the tests need five commands.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tungstenite::stream::MaybeTlsStream;

/// The system's Chromium, or None (the test then says it skipped; with
/// `FRAGSCOPE_REQUIRE_BROWSER=1`, as in CI, it fails instead).
pub fn chromium() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|b| {
        std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(b)).find(|p| p.is_file())
    });
    if found.is_none() {
        let required = ["FRAGSCOPE_REQUIRE_BROWSER", "FRAGSCOPE_REQUIRE_PYTHON"]
            .iter()
            .any(|v| std::env::var(v).as_deref() == Ok("1"));
        assert!(!required, "no chromium: run scripts/install-deps");
        eprintln!("skipped: no chromium to render the pages (scripts/install-deps installs it)");
    }
    found
}

pub struct Browser {
    child: Child,
    ws: tungstenite::WebSocket<MaybeTlsStream<TcpStream>>,
    session: String,
    next: u64,
    /// Every event the page sent, in order.
    pub events: Vec<Value>,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium with one page of `width` × `height` CSS pixels at
    /// a device pixel ratio of 1.
    pub fn launch(chromium: &Path, width: u32, height: u32) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0", "--no-first-run"])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("--window-size={width},{height}"))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start chromium");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("chromium ended before it listened").unwrap();
            if let Some(at) = line.find("ws://") {
                break line[at..].trim().to_string();
            }
        };
        // Keep reading its stderr, or it blocks once the pipe is full.
        std::thread::spawn(move || for _ in lines {});
        let (ws, _) = tungstenite::connect(&url).expect("cannot connect to chromium");
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        }
        let mut b = Browser { child, ws, session: String::new(), next: 0, events: Vec::new(), _profile: profile };
        let target = b.send(None, "Target.createTarget", json!({"url": "about:blank"}));
        let target = target["targetId"].as_str().unwrap().to_string();
        let attached = b.send(None, "Target.attachToTarget", json!({"targetId": target, "flatten": true}));
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        for domain in ["Page", "Runtime", "Network", "Log"] {
            b.call(&format!("{domain}.enable"), json!({}));
        }
        b.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        );
        b
    }

    fn send(&mut self, session: Option<String>, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        self.ws.send(tungstenite::Message::text(msg.to_string())).unwrap();
        loop {
            let m = self.ws.read().unwrap_or_else(|e| panic!("{method}: {e}"));
            let Ok(text) = m.to_text() else { continue };
            let v: Value = serde_json::from_str(text).unwrap();
            if v["id"] == json!(id) {
                assert!(v.get("error").is_none(), "{method}: {}", v["error"]);
                return v["result"].clone();
            }
            if v.get("method").is_some() {
                self.events.push(v);
            }
        }
    }

    /// A command to the page.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        let s = self.session.clone();
        self.send(Some(s), method, params)
    }

    /// Loads `path` and waits for its load event.
    pub fn open(&mut self, path: &Path, fragment: &str) {
        let url = format!("file://{}{fragment}", path.canonicalize().unwrap().display());
        self.call("Page.navigate", json!({"url": url}));
        self.wait_for("document.readyState === 'complete'", Duration::from_secs(60));
    }

    /// The value of a JavaScript expression (promises awaited).
    pub fn eval(&mut self, expr: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({"expression": expr, "returnByValue": true, "awaitPromise": true}));
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {}", r["exceptionDetails"]);
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is true.
    pub fn wait_for(&mut self, expr: &str, timeout: Duration) {
        let started = Instant::now();
        while self.eval(&format!("!!({expr})")) != json!(true) {
            assert!(started.elapsed() < timeout, "timed out waiting for {expr}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn mouse(&mut self, kind: &str, x: f64, y: f64) {
        self.call("Input.dispatchMouseEvent", json!({"type": kind, "x": x, "y": y, "button": "none"}));
    }

    /// A wheel turn at (x, y); `modifiers` as the protocol counts them
    /// (8: Shift, 1: Alt).
    pub fn wheel(&mut self, x: f64, y: f64, delta_y: f64, modifiers: u32) {
        self.call(
            "Input.dispatchMouseEvent",
            json!({"type": "mouseWheel", "x": x, "y": y, "deltaX": 0, "deltaY": delta_y, "modifiers": modifiers}),
        );
    }

    /// A screenshot of a rectangle of the page, as RGB rows.
    pub fn screenshot(&mut self, x: f64, y: f64, w: f64, h: f64) -> crate::common::Rgb {
        use base64::Engine as _;
        let r = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "clip": {"x": x, "y": y, "width": w, "height": h, "scale": 1}}),
        );
        let png = base64::engine::general_purpose::STANDARD.decode(r["data"].as_str().unwrap()).unwrap();
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(tmp.path(), png).unwrap();
        crate::common::read_png(tmp.path())
    }

    /// Errors the page logged or threw.
    pub fn console_errors(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| match e["method"].as_str()? {
                "Runtime.exceptionThrown" => Some(e["params"]["exceptionDetails"].to_string()),
                "Runtime.consoleAPICalled" if e["params"]["type"] == "error" => Some(e["params"]["args"].to_string()),
                "Log.entryAdded" if e["params"]["entry"]["level"] == "error" => {
                    Some(e["params"]["entry"]["text"].to_string())
                }
                _ => None,
            })
            .collect()
    }

    /// The URLs the page asked for, in order.
    pub fn requests(&self) -> Vec<String> {
        self.events
            .iter()
            .filter(|e| e["method"] == "Network.requestWillBeSent")
            .filter_map(|e| e["params"]["request"]["url"].as_str().map(str::to_string))
            .collect()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
