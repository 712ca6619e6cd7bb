// Command imagecopy copies an image between containers/image transports,
// as `skopeo copy` does (skopeo is a command line over this same library,
// and `podman load` reads archives through its oci-archive and
// docker-archive transports), and prints the copied image's config. Only
// the transports that need no container storage are linked:
// oci-archive:, oci: and dir:.
//
//	imagecopy oci-archive:epp.oci.tar oci:/tmp/layout:epp
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/containers/image/v5/copy"
	"github.com/containers/image/v5/directory"
	"github.com/containers/image/v5/image"
	ociarchive "github.com/containers/image/v5/oci/archive"
	ocilayout "github.com/containers/image/v5/oci/layout"
	"github.com/containers/image/v5/signature"
	"github.com/containers/image/v5/types"
)

func parse(ref string) (types.ImageReference, error) {
	transport, rest, ok := strings.Cut(ref, ":")
	if !ok {
		return nil, fmt.Errorf("%q: want TRANSPORT:REFERENCE", ref)
	}
	switch transport {
	case "oci-archive":
		return ociarchive.Transport.ParseReference(rest)
	case "oci":
		return ocilayout.Transport.ParseReference(rest)
	case "dir":
		return directory.Transport.ParseReference(rest)
	}
	return nil, fmt.Errorf("transport %q is not linked (oci-archive, oci, dir)", transport)
}

func run(src, dst string) error {
	ctx := context.Background()
	srcRef, err := parse(src)
	if err != nil {
		return err
	}
	dstRef, err := parse(dst)
	if err != nil {
		return err
	}
	policy, err := signature.NewPolicyContext(&signature.Policy{
		Default: []signature.PolicyRequirement{signature.NewPRInsecureAcceptAnything()},
	})
	if err != nil {
		return err
	}
	defer policy.Destroy()
	if _, err := copy.Image(ctx, policy, dstRef, srcRef, &copy.Options{}); err != nil {
		return fmt.Errorf("copy: %w", err)
	}
	// Read back what was written: its config as the runtime will see it.
	source, err := dstRef.NewImageSource(ctx, nil)
	if err != nil {
		return err
	}
	defer source.Close()
	img, err := image.FromUnparsedImage(ctx, nil, image.UnparsedInstance(source, nil))
	if err != nil {
		return err
	}
	config, err := img.OCIConfig(ctx)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(config)
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: imagecopy SOURCE DESTINATION")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, "imagecopy:", err)
		os.Exit(1)
	}
}
