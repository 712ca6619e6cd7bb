fn main() {
    print!("{}", kinference_api::crd_yaml());
}
